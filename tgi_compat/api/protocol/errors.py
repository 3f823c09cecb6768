"""TGI's error shapes (docs/contract.md §1, §6) and axum-style JSON body rejections.

Two families:
* `TgiError`: a router `InferError`, answered as `{"error": ..., "error_type": ...}` JSON (or as one
  SSE data event on streaming routes).
* `BodyRejection`: the body could not be read into the request type. axum answers these in
  text/plain (415/413/400/422) with fixed prefixes, never FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from tgi_compat.api.protocol.serde import SerdeSyntaxError, loads
from tgi_compat.api.protocol.tgi import RUST_TYPES


class TgiError(Exception):
    def __init__(self, status: int, message: str, error_type: str, metric_label: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.metric_label = metric_label  # `err` label of tgi_request_failure

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def validation_error(message: str) -> TgiError:
    return TgiError(422, f"Input validation error: {message}", "validation", "validation")


def overloaded_error() -> TgiError:
    return TgiError(429, "Model is overloaded", "overloaded", "overloaded")


def generation_error(cause: str) -> TgiError:
    return TgiError(424, f"Request failed during generation: {cause}", "generation", "generation")


def incomplete_generation_error(streaming: bool) -> TgiError:
    if streaming:
        return TgiError(500, "Incomplete generation stream", "incomplete_generation_stream", "incomplete")
    return TgiError(500, "Incomplete generation", "incomplete_generation", "incomplete")


def unhealthy_response() -> JSONResponse:
    return JSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, status_code=503)


# ------------------------------------------------------------------------------ body parsing


class BodyRejection(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text

    def response(self) -> Response:
        return PlainTextResponse(self.text, status_code=self.status)


Model = TypeVar("Model", bound=BaseModel)
DescribeError = Callable[[dict[str, Any], Any], str]  # (pydantic error, document) -> serde text


def is_json_content_type(header: str | None) -> bool:
    if not header:
        return False
    mime = header.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyRejection(413, "Failed to buffer the request body: length limit exceeded")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyRejection(413, "Failed to buffer the request body: length limit exceeded")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_json_body(
    request: Request, model: type[Model], limit: int, describe: DescribeError | None = None
) -> Model:
    """axum's `Json<T>` extractor: 415 content type, 413 size, 400 syntax, 422 shape.
    `describe` words a pydantic error as serde would (default: deserialize_message)."""
    if not is_json_content_type(request.headers.get("content-type")):
        raise BodyRejection(415, "Expected request with `Content-Type: application/json`")
    raw = await read_body(request, limit)
    return parse_json_bytes(raw, model, describe)


def parse_json_bytes(raw: bytes, model: type[Model], describe: DescribeError | None = None) -> Model:
    document = load_json(raw)
    try:
        return model.model_validate(document, strict=True)
    except ValidationError as error:
        first = cast(dict[str, Any], error.errors()[0])  # pydantic's ErrorDetails TypedDict
        detail = (describe or deserialize_message)(first, document)
        raise BodyRejection(422, f"Failed to deserialize the JSON body into the target type: {detail}") from error


SERDE_RECURSION_LIMIT = 128  # serde_json's nesting limit: deeper bodies are a 400 in TGI, never parsed
_JSON_STRING_OR_BRACKET = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def load_json(raw: bytes) -> Any:
    """The body as serde_json reads it (tgi_compat.api.protocol.serde), with its errors: 400 for bad
    syntax, for what serde refuses and json reads, and for nesting past serde's limit."""
    try:
        document = loads(raw)
    except SerdeSyntaxError as error:
        raise BodyRejection(400, f"Failed to parse the request body as JSON: {error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BodyRejection(400, f"Failed to parse the request body as JSON: {syntax_message(error)}") from None
    except RecursionError:
        document = None  # nested past Python's own limit: past serde's too, found below
    if (position := _nesting_overflow(raw)) is not None:
        line, column = position
        raise BodyRejection(
            400, f"Failed to parse the request body as JSON: recursion limit exceeded at line {line} column {column}"
        )
    return document


def _nesting_overflow(raw: bytes) -> tuple[int, int] | None:
    """(line, column) of the first bracket nested SERDE_RECURSION_LIMIT deep, if any (strings skipped)."""
    if raw.count(b"[") + raw.count(b"{") < SERDE_RECURSION_LIMIT:
        return None  # the usual body: no scan
    depth = 0
    for match in _JSON_STRING_OR_BRACKET.finditer(raw):
        char = raw[match.start()]
        if char in b"[{":
            depth += 1
            if depth == SERDE_RECURSION_LIMIT:
                start = match.start()
                line_start = raw.rfind(b"\n", 0, start) + 1
                return raw.count(b"\n", 0, start) + 1, start - line_start + 1
        elif char in b"]}":
            depth -= 1
    return None


def syntax_message(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        if error.pos >= len(error.doc) or error.msg.startswith("Unterminated"):
            text = "EOF while parsing a value"
        elif error.msg == "Expecting value":
            text = "expected value"
        else:
            text = error.msg[0].lower() + error.msg[1:]
        return f"{text} at line {error.lineno} column {error.colno}"
    return "invalid unicode code point"


def _describe_json(value: Any) -> str:
    # serde's `Unexpected` wording for the value it found.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def _expected(field: str, error_type: str) -> str:
    if field in RUST_TYPES:
        return RUST_TYPES[field]
    if error_type.startswith("bool"):
        return "a boolean"
    if error_type.startswith("string") or field in ("inputs", "adapter_id"):
        return "a string"
    if error_type.startswith("list") or field == "stop":
        return "a sequence"
    return "a valid value"


def deserialize_message(error: dict[str, Any], document: Any) -> str:
    """serde_path_to_error style: `parameters.top_k: invalid type: string "a", expected i32`."""
    loc = [part for part in error["loc"] if not str(part).startswith(("function-", "json-or-python"))]
    path = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[")
    field_names = [p for p in loc if isinstance(p, str)]
    field = field_names[-1] if field_names else ""
    kind = error["type"]
    if kind == "duplicate_field":  # raised by the struct itself: its own path
        prefix = f"{path}: " if path else ""
        return f"{prefix}duplicate field `{error['ctx']['field']}`"
    if kind == "missing":
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        prefix = f"{parent}: " if parent else ""
        return f"{prefix}missing field `{field}`"
    value = error.get("input")
    expected = _expected(field, kind)
    if kind == "literal_error":
        return f"{path}: unknown variant `{value}`, expected one of `json`, `json_object`, `regex`, `json_schema`"
    if kind in ("greater_than_equal", "less_than_equal"):
        return f"{path}: invalid value: {_describe_json(value)}, expected {expected}"
    return f"{path}: invalid type: {_describe_json(value)}, expected {expected}"
