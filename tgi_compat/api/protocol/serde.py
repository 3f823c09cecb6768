"""Request JSON read as TGI reads it: serde_json's `from_slice` into `#[derive(Deserialize)]` structs.

Python's json module is more lenient than serde_json, and each leniency lets a request mean something
other than what TGI (or a proxy in front of us) would read:
* `NaN`, `Infinity`, `-Infinity` and numbers past f64 (`1e999`) are syntax errors, not floats;
* a UTF-8 BOM is not JSON, nor is any other encoding than UTF-8;
* a `\\u` escape of half a surrogate pair is refused, not kept as an unpaired code point;
* a struct refuses a field given twice (`duplicate field`), where json keeps the last value; free-form
  JSON values (a schema, tool arguments) keep the last value, as serde_json's `Value` does;
* f32 parameters are f32: `temperature: 1e-320` is 0 to TGI, and `1e39` is inf.

`loads` reads the text (SerdeSyntaxError: serde's message, TGI's 400); `SerdeModel` is the base of every
request model, and `F32` the type of every float parameter.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


class SerdeSyntaxError(ValueError):
    """serde_json's text for a document it cannot parse, position included."""


class RepeatedKeys(dict[str, Any]):
    """A JSON object that names a key more than once: the last value stands (serde_json's `Value`),
    and `repeated` lists the repeats in document order for the struct that refuses them."""

    __slots__ = ("repeated",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.repeated: list[str] = []
        for key, _ in pairs:
            if key in seen:
                self.repeated.append(key)
            seen.add(key)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    return document if len(document) == len(pairs) else RepeatedKeys(pairs)


class _NotSerde(Exception):
    """A literal json reads and serde_json refuses (the hooks below raise it with the literal's text)."""

    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _constant(literal: str) -> float:
    raise _NotSerde(literal)


def _float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise _NotSerde(literal)  # serde_json: "number out of range"
    return value


def _int(literal: str) -> int | float:
    if len(literal) <= 20 and -(2**63) <= (value := int(literal)) < 2**64:
        return value
    return _float(literal)  # serde_json reads an integer past u64 (i64) as f64


_DECODER = json.JSONDecoder(
    object_pairs_hook=_json_object, parse_float=_float, parse_int=_int, parse_constant=_constant
)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Everything up to the first unpaired surrogate escape (JSON has backslashes only inside strings, and each
# one starts an escape, so reading escapes from the start pairs them right); possessive: no backtracking.
_UNTIL_LONE_SURROGATE = re.compile(
    rb"(?:[^\\]++|\\[^u]|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4}|\\u[dD][89abAB]..\\u[dD][c-fC-F]..)*+", re.S
)


def loads(raw: bytes) -> Any:
    """The document, or SerdeSyntaxError where serde_json refuses what json reads
    (json's own errors, JSONDecodeError and UnicodeDecodeError, pass through)."""
    text = raw.decode("utf-8")
    try:
        document = _DECODER.decode(text)
    except _NotSerde as refused:
        raise _literal_error(raw, refused.literal.encode()) from None
    if _SURROGATE_ESCAPE.search(raw) and (end := _UNTIL_LONE_SURROGATE.match(raw).end()) < len(raw):  # type: ignore[union-attr]
        raise _lone_surrogate_error(raw, end)
    return document


def _literal_error(raw: bytes, literal: bytes) -> SerdeSyntaxError:
    index = _index_outside_strings(raw, literal)
    if literal in (b"NaN", b"Infinity"):
        return _syntax_error("expected value", raw, index + 1)  # serde peeks at the first letter
    if literal == b"-Infinity":
        return _syntax_error("invalid number", raw, index + 2)  # the letter after the sign
    return _syntax_error("number out of range", raw, index + _out_of_range_length(literal))


def _out_of_range_length(literal: bytes) -> int:
    """How much of a number serde_json reads before it is out of range: all of it, unless the exponent's
    digits overflow an i32 first (serde stops at the digit that does)."""
    mantissa, _, exponent = literal.lower().partition(b"e")
    if not exponent.lstrip(b"+").isdigit():  # no exponent, or a negative one
        return len(literal)
    value, start = 0, len(mantissa) + 1 + (exponent[:1] == b"+")
    for offset, digit in enumerate(exponent.lstrip(b"+")):
        value = value * 10 + digit - 48
        if value > 2**31 - 1:
            return start + offset + 1
    return len(literal)


def _index_outside_strings(raw: bytes, literal: bytes) -> int:
    """Where `literal` first stands as a token of its own outside the document's strings: json
    reads in document order, so that is the literal it refused."""
    first, rest = re.escape(literal[:1]), re.escape(literal[1:])
    string = rb'"(?:[^"\\]++|\\.)*+"'
    skip = re.compile(rb'(?:[^"' + first + rb"]++|" + string + rb"|" + first + rb"(?!" + rest + rb"))*+", re.S)
    index = -1
    while True:
        index = skip.match(raw, index + 1).end()  # type: ignore[union-attr]
        end = index + len(literal)
        alone = (index == 0 or raw[index - 1] not in _NUMBER_BYTES) and (
            end >= len(raw) or raw[end] not in _NUMBER_BYTES
        )
        if alone or end >= len(raw):
            return index


_NUMBER_BYTES = frozenset(b"0123456789.eE+-")  # a literal next to one of these is part of a longer number


def _lone_surrogate_error(raw: bytes, index: int) -> SerdeSyntaxError:
    """serde_json's error for the `\\uXXXX` at `index` (a surrogate json paired with nothing)."""
    if raw[index + 3 : index + 4] in b"cCdDeEfF":  # uDC00-uDFFF: a trailing half first
        return _syntax_error("lone leading surrogate in hex escape", raw, index + 6)
    if raw[index + 6 : index + 8] == b"\\u":  # another escape, not a trailing half
        return _syntax_error("lone leading surrogate in hex escape", raw, index + 12)
    consumed = 2 if raw[index + 6 : index + 7] == b"\\" else 1  # serde reads one byte past, or two after `\`
    return _syntax_error("unexpected end of hex escape", raw, index + 6 + consumed)


def _syntax_error(message: str, raw: bytes, consumed: int) -> SerdeSyntaxError:
    """serde_json's position: the line, and the bytes of that line read so far."""
    line_start = raw.rfind(b"\n", 0, consumed) + 1
    line = raw.count(b"\n", 0, line_start) + 1
    return SerdeSyntaxError(f"{message} at line {line} column {consumed - line_start}")


def _to_f32(value: float) -> float:
    """The f32 serde makes of the number (`as f32`: nearest, inf past f32::MAX, 0 under its smallest)."""
    return ctypes.c_float(value).value


F32 = Annotated[float, AfterValidator(_to_f32)]


class SerdeModel(BaseModel):
    """A request struct: strict types, unknown keys ignored, `null` only for Option fields (declared so),
    and a field given twice refused with serde's `duplicate field` (before any other check)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_repeated_field(cls, data: Any) -> Any:
        if isinstance(data, RepeatedKeys):
            names = _wire_names(cls)
            for key in data.repeated:
                if key in names:  # serde ignores unknown keys, repeated or not
                    raise PydanticCustomError("duplicate_field", "duplicate field `{field}`", {"field": key})
        return data


def _wire_names(model: type[BaseModel]) -> set[str]:
    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(field.alias or name)
        if isinstance(field.validation_alias, AliasChoices):
            names.update(choice for choice in field.validation_alias.choices if isinstance(choice, str))
    return names
