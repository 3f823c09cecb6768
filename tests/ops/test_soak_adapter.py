"""The soak's reading of TGI's OpenAPI document (benchmarks/soak/openapi.py `tgi_as_served`): what TGI answers must
conform to it, and what TGI refuses must not be described as valid. Checked with schemathesis' own
response validation, as the soak runs it."""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from schemathesis.core.transport import Response

from benchmarks.soak import openapi as soak
from benchmarks.soak import tgi_hooks

# GET /info of a server launched with the soak's flags
INFO = {
    "max_best_of": 2,
    "max_stop_sequences": 4,
    "max_input_tokens": 256,
    "max_total_tokens": 512,
    "max_client_batch_size": 4,
}
TOKEN_EVENT = (
    b'data:{"index":1,"token":{"id":141,"text":"","logprob":-2.08,"special":false},'
    b'"generated_text":null,"details":null}\n\n'
)
TGI_ERROR_EVENT = (
    b'data:{"error":"Input validation error: `top_p` must be > 0.0 and < 1.0","error_type":"validation"}\n\n'
)
CHAT_CHUNK = (
    b'data:{"object":"chat.completion.chunk","id":"","created":1,"model":"m","system_fingerprint":"x",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"logprobs":null,"finish_reason":null}],'
    b'"usage":null}\n\n'
)
OPENAI_ERROR_EVENT = b'data:{"error":{"message":"Input validation error: x","http_status_code":422}}\n\n'


@pytest.fixture(scope="module")
def document() -> dict:
    return soak.tgi_as_served(soak.openapi_30(json.loads(soak.SPEC.read_text())), INFO)


@pytest.fixture(scope="module")
def schema(document):
    return schemathesis.openapi.from_dict(document)


def _response(path: str, content: bytes, content_type: str, status: int = 200) -> Response:
    request = requests.Request("POST", f"http://server{path}").prepare()
    headers = {"content-type": [content_type]}
    return Response(status_code=status, headers=headers, content=content, request=request, elapsed=0.1, verify=True)


def _conforms(schema, method: str, path: str, response: Response) -> bool:
    tgi_hooks.after_call(None, None, response)
    try:
        schema[path][method].validate_response(response)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("path", ["/", "/generate_stream", "/invocations"])
def test_tgi_stream_events_and_their_error_event_conform(schema, path):
    for content in (TOKEN_EVENT * 2, TGI_ERROR_EVENT):
        assert _conforms(schema, "POST", path, _response(path, content, "text/event-stream"))
    assert not _conforms(schema, "POST", path, _response(path, b'data:{"index":1}\n\n', "text/event-stream"))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
def test_openai_stream_events_end_with_done(schema, path):
    for content in (CHAT_CHUNK * 2 + tgi_hooks.DONE, OPENAI_ERROR_EVENT + tgi_hooks.DONE):
        assert _conforms(schema, "POST", path, _response(path, content, "text/event-stream"))
    bad = b'data:{"object":"chat.completion.chunk"}\n\n' + tgi_hooks.DONE
    assert not _conforms(schema, "POST", "/v1/chat/completions", _response(path, bad, "text/event-stream"))


def test_tokenize_routes_document_tgis_json_422(schema):
    body = b'{"error":"Template error: template not found","error_type":"template_error"}'
    for path in ("/tokenize", "/chat_tokenize"):
        assert _conforms(schema, "POST", path, _response(path, body, "application/json", 422))


def test_get_root_is_health(schema):
    request = requests.Request("GET", "http://server/").prepare()
    ok = Response(status_code=200, headers={}, content=b"", request=request, elapsed=0.1, verify=True)
    schema["/"]["GET"].validate_response(ok)


def test_no_string_null_defaults_left(document):
    text = json.dumps(document)
    assert '"default": "null"' not in text and '"example": "null"' not in text


def test_request_shapes_match_tgis_serde(document):
    schemas = document["components"]["schemas"]
    assert "nullable" not in schemas["ChatRequest"]["properties"]["stream_options"]  # null: 422 in TGI
    assert [choice["enum"] for choice in schemas["ToolChoice"]["oneOf"]] == [["auto"], ["none"], ["required"]]
    prompt = schemas["Prompt"]["anyOf"]
    text = {"type": "string", "minLength": 1, "maxLength": 60}  # "`inputs` cannot be empty", <= 240 tokens
    assert text in prompt and {"type": "array", "items": text, "minItems": 1, "maxItems": 4} in prompt
    assert schemas["GenerateRequest"]["properties"]["inputs"]["minLength"] == 1
    max_new_tokens = schemas["GenerateParameters"]["properties"]["max_new_tokens"]
    assert (max_new_tokens["default"], max_new_tokens["example"]) == (1024, 20)  # utoipa wrote "1024", "20"


def test_first_event_of_a_rejected_stream_is_seen():
    assert tgi_hooks._first_event(_response("/", TGI_ERROR_EVENT, "text/event-stream"))["error_type"] == "validation"
    assert "error" not in tgi_hooks._first_event(_response("/", TOKEN_EVENT, "text/event-stream"))


def test_validation_bounds_follow_the_servers_limits(document):
    parameters = document["components"]["schemas"]["GenerateParameters"]["properties"]
    assert (parameters["max_new_tokens"]["minimum"], parameters["max_new_tokens"]["maximum"]) == (1, 256)
    assert (parameters["truncate"]["minimum"], parameters["truncate"]["maximum"]) == (1, 256)
    assert parameters["top_p"]["exclusiveMaximum"] is True and parameters["top_p"]["maximum"] == 1  # 1.0: a 422
    assert parameters["seed"]["exclusiveMinimum"] is False  # seed 0 is accepted


def test_only_the_soaks_own_length_bounds_are_excused():
    excused = "Invalid data should have been rejected\nExpected: 400\nInvalid component: in body - max_tokens: Value greater than maximum"
    assert tgi_hooks.only_soak_bounds(excused)
    reported = "Invalid data should have been rejected\nInvalid component: in body - top_p: Value greater than maximum"
    assert not tgi_hooks.only_soak_bounds(reported)
    assert tgi_hooks.only_soak_bounds(
        "Invalid component: in body - prompt -> Array with invalid items: String larger than maxLength"
    )
    assert tgi_hooks.only_soak_bounds(  # the wording of the 20-minute soak's one finding (2026-11-24)
        "Invalid component: in body - violates `maxLength` at /$ref/schema000001/properties/inputs "
        '(was "V G", became "V G*****")'
    )
    assert not tgi_hooks.only_soak_bounds("Invalid component: in body - violates `minimum` at /properties/seed")
    mixed = "Invalid component: in body\n  - inputs: String larger than maxLength\n  - seed: Value smaller than minimum"
    assert not tgi_hooks.only_soak_bounds(mixed)
