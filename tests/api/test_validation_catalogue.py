"""Every validation row of docs/contract.md §4 and every body rejection of §1, with TGI's exact texts."""

from __future__ import annotations

import json

import pytest

from tgi_compat.api.serving.validation import REFUSAL_TEXTS
from tgi_compat.router.client_api import Refusal, RequestRejectedError

PROMPT = "What is the capital of France?"

# (parameters, inputs, exact message after "Input validation error: ") — max_total_tokens is 64 here.
ROWS = [
    ({"best_of": 2}, PROMPT, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, PROMPT, "`seed` must not be set when `best_of` > 1"),
    ({"best_of": 3, "do_sample": True}, PROMPT, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"temperature": 0}, PROMPT, "`temperature` must be strictly positive"),
    ({"temperature": -1.0}, PROMPT, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, PROMPT, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, PROMPT, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, PROMPT, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0}, PROMPT, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0}, PROMPT, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, PROMPT, "`top_k` must be strictly positive"),
    ({"top_k": -3}, PROMPT, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, PROMPT, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, PROMPT, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"top_n_tokens": 6}, PROMPT, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({}, "", "`inputs` cannot be empty"),
    ({"truncate": 0}, PROMPT, "`truncate` must be strictly positive and less than 63. Given: 0"),
    ({"truncate": 64}, PROMPT, "`truncate` must be strictly positive and less than 63. Given: 64"),
    (
        {"max_new_tokens": 60},
        PROMPT,
        "`inputs` tokens + `max_new_tokens` must be <= 64. Given: 7 `inputs` tokens and 60 `max_new_tokens`",
    ),
    ({}, "hello " * 63, "`inputs` must have less than 63 tokens. Given: 64"),
    # grammar (TGI's checks; the engine refuses what does not compile)
    ({"grammar": {"type": "json", "value": 5}}, PROMPT, "grammar is not supported"),
    (
        {"grammar": {"type": "json", "value": "{bad"}},
        PROMPT,
        "grammar is not valid: key must be a string at line 1 column 2",
    ),
    (
        {"grammar": {"type": "json", "value": "[1,"}},
        PROMPT,
        "grammar is not valid: EOF while parsing a value at line 1 column 4",
    ),
    (
        {"grammar": {"type": "json", "value": {"type": "object"}}},
        PROMPT,
        "grammar is not valid: Grammar must have a 'properties' field",
    ),
    (
        {"grammar": {"type": "json_object", "value": '{"required": []}'}},
        PROMPT,
        "grammar is not valid: Grammar must have a 'properties' field",
    ),
    (
        {"grammar": {"type": "json", "value": {"type": "strin", "properties": {}}}},
        PROMPT,
        "grammar is not valid: \"strin\" is not valid under any of the schemas listed in the 'anyOf' keyword",
    ),
    (
        {"grammar": {"type": "json", "value": {"properties": 5}}},
        PROMPT,
        'grammar is not valid: 5 is not of type "object"',
    ),
    (
        {"grammar": {"type": "json_schema", "value": {"name": "x", "schema": {"type": "object"}}}},
        PROMPT,
        "grammar is not valid: Grammar must have a 'properties' field",
    ),
    # order: temperature is checked before top_p, top_p before top_k
    ({"temperature": 0, "top_p": 1.0}, PROMPT, "`temperature` must be strictly positive"),
    ({"top_p": 1.0, "top_k": 0}, PROMPT, "`top_p` must be > 0.0 and < 1.0"),
]


@pytest.mark.parametrize(("params", "inputs", "message"), ROWS)
async def test_validation_error_texts(client, params, inputs, message):
    response = await client.post("/generate", json={"inputs": inputs, "parameters": params})
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": f"Input validation error: {message}", "error_type": "validation"}


ENGINE_REFUSALS = [
    ((Refusal.UNKNOWN_ADAPTER, "nope", "a1", "a2"), "LoRA adapter 'nope' is not loaded; loaded: a1, a2"),
    ((Refusal.UNKNOWN_ADAPTER, "nope"), "LoRA adapter 'nope' is not loaded; no adapter is loaded"),
    ((Refusal.PROMPT_TOKEN, 70000, 49152), "`prompt` token id 70000 is outside the vocabulary (size 49152)"),
    ((Refusal.LOGIT_BIAS_TOKEN, 70000, 49152), "`logit_bias` token id 70000 is outside the vocabulary (size 49152)"),
    ((Refusal.SEED,), "`seed` must be an unsigned 64-bit integer"),
    (
        (Refusal.TOTAL_TOKENS, 32, 7, 30),
        "`inputs` tokens + `max_new_tokens` must be <= 32. Given: 7 `inputs` tokens and 30 `max_new_tokens`",
    ),
]


@pytest.mark.parametrize(("refusal", "message"), ENGINE_REFUSALS)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
async def test_engine_refusals_reach_the_client_as_tgi_texts(client, engine, refusal, message, path):
    """The engine sends a code and its values; the API holds TGI's texts (one table for both sides)."""
    engine.refuse_with = RequestRejectedError(*refusal)
    response = await client.post(path, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}})
    expected = {"error": f"Input validation error: {message}", "error_type": "validation"}
    if path == "/generate":
        assert response.status_code == 422 and response.json() == expected
    else:
        assert response.text.strip() == f"data:{json.dumps(expected, separators=(',', ':'))}"


def test_every_refusal_has_a_text():
    assert set(REFUSAL_TEXTS) == set(Refusal)


async def test_disabled_grammar_support_refuses_every_grammar(make_client, engine):
    async with make_client(engine, disable_grammar_support=True) as http:
        params = {"grammar": {"type": "regex", "value": "a+"}}
        response = await http.post("/generate", json={"inputs": PROMPT, "parameters": params})
    assert response.json() == {"error": "Input validation error: grammar is not supported", "error_type": "validation"}


async def test_a_valid_grammar_reaches_the_engine_as_a_spec(client, engine):
    from tgi_compat.router.request import GrammarKind, GrammarSpec

    schema = {"properties": {"a": {"type": "integer"}}}
    for grammar, spec in [
        ({"type": "regex", "value": "a+"}, GrammarSpec(GrammarKind.REGEX, "a+")),
        ({"type": "json", "value": schema}, GrammarSpec(GrammarKind.JSON_SCHEMA, '{"properties":{"a":{"type":"integer"}}}')),
        ({"type": "json_object", "value": '{"properties": {"a": {"type": "integer"}}}'}, GrammarSpec(GrammarKind.JSON_SCHEMA, '{"properties":{"a":{"type":"integer"}}}')),
        ({"type": "json_schema", "value": {"name": "n", "schema": schema, "strict": True}}, GrammarSpec(GrammarKind.JSON_SCHEMA, '{"properties":{"a":{"type":"integer"}}}')),
    ]:  # fmt: skip
        response = await client.post("/generate", json={"inputs": PROMPT, "parameters": {"grammar": grammar}})
        assert response.status_code == 200, response.text
        assert engine.requests[-1].grammar == spec


async def test_max_best_of_one_forbids_best_of(make_client, engine):
    async with make_client(engine, max_best_of=1) as http:
        params = {"best_of": 2, "do_sample": True}
        response = await http.post("/generate", json={"inputs": PROMPT, "parameters": params})
    assert response.json()["error"] == "Input validation error: `best_of` != 1 is not allowed for this endpoint"


async def test_huge_max_new_tokens_passes_the_chunked_budget(make_client, continuation):
    from scripted_engine import ScriptedEngine

    big = ScriptedEngine(continuation, max_total_tokens=2048)
    async with make_client(big) as http:
        response = await http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 100000}})
    assert response.status_code == 200
    assert big.requests[0].max_new_tokens == 2048 - 7


async def test_stream_only_checks_come_first(client):
    # best_of != 1 is rejected in streams even when sampling is missing or best_of is 0.
    for best_of in (0, 2):
        response = await client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"best_of": best_of}})
        assert b"`best_of` != 1 is not supported when streaming tokens" in response.content
    # best_of=0 behaves like 1 on /generate
    assert (await client.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 0}})).status_code == 200


BODY_REJECTIONS = [
    ({"content": b"{}", "headers": {"content-type": "text/plain"}}, 415, "Expected request with `Content-Type: application/json`"),
    ({"content": b"{}", "headers": {}}, 415, "Expected request with `Content-Type: application/json`"),
    ({"content": b'{"inputs": ', "headers": {"content-type": "application/json"}}, 400, "Failed to parse the request body as JSON: "),
    ({"content": b"{}", "headers": {"content-type": "application/json"}}, 422, "Failed to deserialize the JSON body into the target type: missing field `inputs`"),
    ({"content": b'{"inputs":"a","parameters":{"stop":null}}', "headers": {"content-type": "application/json; charset=utf-8"}}, 422, "Failed to deserialize the JSON body into the target type: parameters.stop: invalid type: null"),
    ({"content": b'{"inputs":"a","parameters":{"do_sample":null}}', "headers": {"content-type": "application/vnd.api+json"}}, 422, "Failed to deserialize the JSON body into the target type: parameters.do_sample: invalid type: null"),
    ({"content": b'{"inputs":"a","parameters":{"top_k":"3"}}', "headers": {"content-type": "application/json"}}, 422, 'Failed to deserialize the JSON body into the target type: parameters.top_k: invalid type: string "3", expected i32'),
    ({"content": b'{"inputs":"a","parameters":{"max_new_tokens":-1}}', "headers": {"content-type": "application/json"}}, 422, "Failed to deserialize the JSON body into the target type: parameters.max_new_tokens: invalid value: integer `-1`, expected u32"),
]  # fmt: skip


@pytest.mark.parametrize(("request_kwargs", "status", "text"), BODY_REJECTIONS)
async def test_body_rejections_are_plain_text(client, request_kwargs, status, text):
    for path in ("/generate", "/generate_stream", "/"):
        response = await client.post(path, **request_kwargs)
        assert response.status_code == status
        assert response.headers["content-type"].startswith("text/plain")
        assert response.text.startswith(text), response.text


async def test_payload_limit_is_413(make_client, engine):
    async with make_client(engine, payload_limit=100) as http:
        response = await http.post("/generate", json={"inputs": "x" * 200})
    assert response.status_code == 413
    assert response.text == "Failed to buffer the request body: length limit exceeded"


async def test_nulls_and_unknown_fields_are_accepted(client):
    params = {
        "do_sample": False,
        "max_new_tokens": 5,
        "repetition_penalty": None,
        "frequency_penalty": None,
        "return_full_text": False,
        "stop": [],
        "seed": None,
        "temperature": None,
        "top_k": None,
        "top_p": None,
        "truncate": None,
        "typical_p": None,
        "best_of": None,
        "watermark": False,
        "details": True,
        "decoder_input_details": False,
        "top_n_tokens": None,
        "grammar": None,
        "adapter_id": None,
        "bogus": 1,
    }
    response = await client.post("/", json={"inputs": PROMPT, "parameters": params, "stream": False, "extra": {}})
    assert response.status_code == 200
    assert response.json()[0]["details"]["generated_tokens"] == 5
