"""Request JSON read as serde_json reads it (tgi_compat.api.protocol.serde): what it refuses that Python's json
reads, with its messages and positions (serde_json 1.0.140's read.rs and de.rs), and the models' `duplicate
field` and f32 rounding."""

from __future__ import annotations

import pytest

from tgi_compat.api.protocol.errors import BodyRejection, deserialize_message, load_json, parse_json_bytes
from tgi_compat.api.protocol.serde import RepeatedKeys, SerdeSyntaxError, loads
from tgi_compat.api.protocol.tgi import GenerateRequest


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a":NaN}', "expected value at line 1 column 6"),  # serde peeks at the N
        (b"[1,\n  Infinity]", "expected value at line 2 column 3"),
        (b'{"a":-Infinity}', "invalid number at line 1 column 7"),  # the letter after the sign
        (b'{"a":1e999}', "number out of range at line 1 column 10"),  # the whole number read
        (b'{"a":1.5e309,"b":1e999}', "number out of range at line 1 column 12"),  # the first one
        (b'{"a":1e99999999999}', "number out of range at line 1 column 17"),  # stops where the exponent overflows
        (b'{"a":' + b"9" * 400 + b"}", "number out of range at line 1 column 405"),  # an integer read as f64
        (b'{"a":"\\udc00"}', "lone leading surrogate in hex escape at line 1 column 12"),  # a trailing half
        (b'{"a":"\\ud800"}', "unexpected end of hex escape at line 1 column 13"),  # one byte past it
        (b'{"a":"\\ud800\\n"}', "unexpected end of hex escape at line 1 column 14"),  # two after a `\`
        (b'{"a":"\\ud800\\u0041"}', "lone leading surrogate in hex escape at line 1 column 18"),
    ],
)
def test_what_serde_refuses_and_json_reads(raw, message):
    with pytest.raises(SerdeSyntaxError) as refused:
        loads(raw)
    assert str(refused.value) == message


def test_what_both_read_alike():
    document = loads(
        b'{"s":"NaN, 1e999 and \\\\ud800 are text","e":"\\ud83d\\ude00","n":[1e308,-0e999,18446744073709551615]}'
    )
    assert document == {"s": "NaN, 1e999 and \\ud800 are text", "e": "\U0001f600", "n": [1e308, -0.0, 2**64 - 1]}


def test_a_bom_is_not_json():
    with pytest.raises(BodyRejection) as refused:
        load_json(b'\xef\xbb\xbf{"inputs":"Hi"}')
    assert refused.value.text == "Failed to parse the request body as JSON: expected value at line 1 column 1"


def test_a_repeated_key_stands_with_its_last_value_and_is_listed():
    document = loads(b'{"a":1,"b":2,"a":3,"b":4,"a":5}')
    assert isinstance(document, RepeatedKeys) and document == {"a": 5, "b": 4}
    assert document.repeated == ["a", "b", "a"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"inputs":"a","inputs":"b"}', "duplicate field `inputs`"),
        (b'{"inputs":"a","parameters":{"seed":1,"seed":2}}', "parameters: duplicate field `seed`"),
        (
            b'{"inputs":"a","parameters":{"grammar":{"type":"regex","type":"json","value":"a"}}}',
            "parameters.grammar: duplicate field `type`",
        ),
    ],
)
def test_a_struct_refuses_a_field_given_twice(raw, message):
    with pytest.raises(BodyRejection) as refused:
        parse_json_bytes(raw, GenerateRequest, deserialize_message)
    assert (refused.value.status, refused.value.text) == (
        422,
        f"Failed to deserialize the JSON body into the target type: {message}",
    )


def test_repeats_serde_ignores():
    """Unknown keys may repeat, and a free-form value (a schema) keeps its last value, as serde_json's Value."""
    raw = b'{"inputs":"a","x":1,"x":2,"parameters":{"grammar":{"type":"json","value":{"properties":{},"properties":{"a":{}}}}}}'
    request = parse_json_bytes(raw, GenerateRequest, deserialize_message)
    assert request.parameters.grammar is not None and request.parameters.grammar.value == {"properties": {"a": {}}}


def test_f32_parameters_hold_what_tgi_deserializes():
    parameters = parse_json_bytes(
        b'{"inputs":"a","parameters":{"temperature":1e-320,"top_p":0.99999999,"repetition_penalty":1e39,"typical_p":0.9}}',
        GenerateRequest,
        deserialize_message,
    ).parameters
    assert (parameters.temperature, parameters.top_p, parameters.repetition_penalty) == (0.0, 1.0, float("inf"))
    assert parameters.typical_p == 0.8999999761581421  # 0.9 rounded to f32
