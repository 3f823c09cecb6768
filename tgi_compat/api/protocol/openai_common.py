"""What the chat and completions routes share: body parsing with serde-style messages, the
served model name, their shared sampling fields as TGI's parameters, finish-reason mapping, OpenAI-route SSE
errors, and the summed x-* headers."""

from __future__ import annotations

import time
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from tgi_compat.api.protocol.errors import TgiError, deserialize_message, parse_json_body
from tgi_compat.api.protocol.openai import ChatRequest, CompletionRequest
from tgi_compat.api.protocol.sse import data_event
from tgi_compat.api.protocol.tgi import TGI_VERSION, GenerateParameters, dump_json
from tgi_compat.router.request import FinishReason

Model = TypeVar("Model", bound=BaseModel)

# Fields TGI deserializes through an untagged enum: serde reports "did not match any variant".
_UNTAGGED_ENUMS = {"prompt": "PromptDeserializer", "content": "MessageContent", "tool_choice": "ToolTypeDeserializer"}


def _path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[")


def _openai_deserialize_message(error: dict[str, Any], document: Any) -> str:
    loc = tuple(error["loc"])
    if error["type"] == "value_error":  # a custom deserializer's own message (e.g. the empty prompt list)
        return f"{_path(loc)}: {error['ctx']['error']}" if loc else str(error["ctx"]["error"])
    for position, part in enumerate(loc):
        if part in _UNTAGGED_ENUMS:
            return (
                f"{_path(loc[: position + 1])}: data did not match any variant of untagged enum {_UNTAGGED_ENUMS[part]}"
            )
    return deserialize_message(error, document)


async def parse_openai_body(request: Request, model: type[Model], limit: int) -> Model:
    """axum's `Json<T>` with serde's texts for the OpenAI bodies' custom deserializers and untagged enums."""
    return await parse_json_body(request, model, limit, describe=_openai_deserialize_message)


def openai_parameters(body: ChatRequest | CompletionRequest, **fields: Any) -> GenerateParameters:
    """TGI's parameters for the sampling fields chat and completions share; `fields`: each one's own."""
    greedy = body.temperature == 0.0  # exactly 0 means greedy; anything else samples
    return GenerateParameters(
        adapter_id=body.model if body.model != "tgi" else None,
        do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        frequency_penalty=body.frequency_penalty,
        top_p=body.top_p,
        max_new_tokens=body.max_tokens,
        stop=list(body.stop or []),
        seed=body.seed,
        details=True,
        **fields,
    )


def system_fingerprint() -> str:
    # TGI: "<version>-<docker_label or 'native'>"; we have no docker label.
    return f"{TGI_VERSION}-native"


def unix_now() -> int:
    return int(time.time())


def openai_finish_reason(finish_reason: str) -> str:
    """TGI's `format(use_stop=true)`: only eos_token becomes "stop"; stop_sequence stays."""
    return "stop" if finish_reason == FinishReason.EOS_TOKEN else finish_reason


def stream_error_event(error: TgiError) -> bytes:
    """Errors inside an OpenAI-route stream: TGI's `into_openai_event` (always 422)."""
    return data_event(dump_json({"error": {"message": error.message, "http_status_code": 422}}))


_SUMMED_MS_HEADERS = ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token")
_SUMMED_COUNT_HEADERS = ("x-compute-characters", "x-prompt-tokens", "x-generated-tokens")


def summed_headers(per_prompt: list[dict[str, str]]) -> dict[str, str]:
    """Non-stream /v1/completions: TGI adds up the x-* headers of its per-prompt generations."""
    if not per_prompt:
        return {}
    # TGI parses each value as an integer: x-compute-time (seconds, a float) never parses, so the
    # aggregate carries no x-compute-time at all.
    total = {"x-compute-type": per_prompt[0]["x-compute-type"]}
    for name in (*_SUMMED_COUNT_HEADERS[:1], *_SUMMED_MS_HEADERS, *_SUMMED_COUNT_HEADERS[1:]):
        total[name] = str(sum(int(headers[name]) for headers in per_prompt))
    return total
