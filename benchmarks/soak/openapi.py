"""TGI's OpenAPI document as TGI serves it, for the soak to fuzz the server from.

The document TGI 3.3 ships (tgi-openapi.json, here as it ships) is OpenAPI 3.1 and leaves out what TGI's code
does; `tgi_as_served` states it, each change with its reason, so that what TGI answers conforms and what TGI
refuses is not described as valid.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

SPEC = Path(__file__).with_name("tgi-openapi.json")  # TGI 3.3's own document, as it ships


def openapi_30(document: dict) -> dict:
    """OpenAPI 3.1's numeric `exclusiveMinimum`/`exclusiveMaximum` in 3.0's boolean form."""
    document = copy.deepcopy(document)

    def fix(node):
        if isinstance(node, dict):
            for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
                value = node.get(flag)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    node[bound], node[flag] = value, True
            for child in node.values():
                fix(child)
        elif isinstance(node, list):
            for child in node:
                fix(child)

    fix(document)
    return document


# What TGI's router answers that its own document leaves out (axum's body extractor, TGI's handlers):
# without these, schemathesis reports TGI's real behaviour as findings.
AXUM_REJECTIONS = {
    "400": "Failed to parse the request body as JSON",
    "413": "Payload larger than --payload-limit",
    "415": "Expected request with `Content-Type: application/json`",
    "422": "Well-formed JSON with wrong types or missing fields",
}
MODEL_LIST = {  # GET /v1/models: TGI answers OpenAI's list of the one served model
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object"}}},
}


ERROR_RESPONSE = {"$ref": "#/components/schemas/ErrorResponse"}
OPENAI_STREAM_ERROR = {  # TGI's `into_openai_event`: errors inside an OpenAI-route stream
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "http_status_code"],
            "properties": {"message": {"type": "string"}, "http_status_code": {"type": "integer"}},
        }
    },
}
HEALTH = {  # GET / is TGI's alias of /health (axum: `.route("/", get(health))`); the document omits it
    "summary": "Health check method",
    "responses": {
        "200": {"description": "Everything is working fine"},
        "503": {
            "description": "Text generation inference is down",
            "content": {"application/json": {"schema": ERROR_RESPONSE}},
        },
    },
}


def _stream_errors(path: str) -> list[dict]:
    """What an error event of `path`'s stream looks like: /invocations answers with either route's shape."""
    if path.startswith("/v1/"):
        return [OPENAI_STREAM_ERROR]
    return [ERROR_RESPONSE, OPENAI_STREAM_ERROR] if path == "/invocations" else [ERROR_RESPONSE]


def sse_events(payload: dict, errors: list[dict]) -> dict:
    """An SSE event whose `data` is JSON matching `payload` or one of TGI's in-stream `errors`. OpenAPI
    3.0 tools read the document's own text/event-stream `schema` as the event object itself
    (`{data, event, ...}`), which no TGI event matches; 3.2's `itemSchema` says what is meant."""
    content = {"anyOf": [payload, *errors]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": content}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _serde_values(node):
    """utoipa writes the Rust values of `default` and `example` as strings ("null", "20", "[{...}]"), and
    serde refuses a string where a number, boolean or object is expected (TGI answers `seed: "null"`
    with a 422 too): put back the values meant. "null" is null even for a string field (a Rust `None`)."""
    if isinstance(node, dict):
        for key in ("default", "example"):
            value = node.get(key)
            if value == "null":
                node[key] = None
            elif isinstance(value, str) and node.get("type") in ("integer", "number", "boolean", "array"):
                with contextlib.suppress(ValueError):  # an array example is JSON text (`messages`)
                    node[key] = json.loads(value)
        for child in node.values():
            _serde_values(child)
    elif isinstance(node, list):
        for child in node:
            _serde_values(child)


MAX_TOP_N_TOKENS = 5  # TGI's --max-top-n-tokens default (not in /info)


def _bounds(info: dict) -> dict[tuple[str, str], dict]:
    """TGI's validation (`Validation::validate` and the chat/completions mappings) as JSON Schema bounds, where
    the document has none or others; the server's limits come from its /info. A value out of these bounds
    is a 422 from TGI, so the document must not call it valid, nor call valid values invalid."""
    max_input, max_total = info["max_input_tokens"], info["max_total_tokens"]
    new_tokens = {"minimum": 1, "maximum": max_total - max_input}  # != 0; any prompt fits the budget
    open_unit = {"exclusiveMinimum": True, "minimum": 0, "exclusiveMaximum": True, "maximum": 1}  # 1.0 refused too
    penalty = {"minimum": -2, "maximum": 2, "exclusiveMinimum": False}  # -2.0 <= x <= 2.0
    u64 = {"format": None, "minimum": 0, "exclusiveMinimum": False, "maximum": 2**64 - 1}  # seeds: u64, not int64
    return {
        ("GenerateParameters", "max_new_tokens"): new_tokens,
        ("GenerateParameters", "top_p"): open_unit,
        ("GenerateParameters", "typical_p"): open_unit,
        ("GenerateParameters", "frequency_penalty"): penalty,
        ("GenerateParameters", "top_n_tokens"): {"minimum": 0, "exclusiveMinimum": False, "maximum": MAX_TOP_N_TOKENS},
        ("GenerateParameters", "truncate"): {"minimum": 1, "maximum": max_input},
        ("GenerateParameters", "seed"): u64,
        ("GenerateParameters", "best_of"): {"minimum": 0, "exclusiveMinimum": False, "maximum": info["max_best_of"]},
        ("GenerateParameters", "stop"): {"maxItems": info["max_stop_sequences"]},
        ("ChatRequest", "max_tokens"): new_tokens,
        ("ChatRequest", "top_logprobs"): {"maximum": MAX_TOP_N_TOKENS},  # becomes top_n_tokens
        ("ChatRequest", "temperature"): {"minimum": 0},  # 0 means greedy
        ("ChatRequest", "top_p"): open_unit,
        ("ChatRequest", "frequency_penalty"): penalty,
        ("ChatRequest", "presence_penalty"): {
            "minimum": -2,
            "exclusiveMinimum": True,
        },  # + 2.0 = repetition_penalty > 0
        ("ChatRequest", "stop"): {"maxItems": info["max_stop_sequences"]},
        ("ChatRequest", "seed"): u64,
        ("CompletionRequest", "max_tokens"): new_tokens,
        ("CompletionRequest", "temperature"): {"minimum": 0},
        ("CompletionRequest", "top_p"): open_unit,
        ("CompletionRequest", "frequency_penalty"): penalty,
        ("CompletionRequest", "repetition_penalty"): {"minimum": 0, "exclusiveMinimum": True},
        ("CompletionRequest", "stop"): {"maxItems": info["max_stop_sequences"]},
        ("CompletionRequest", "seed"): u64,
        ("CompletionRequest", "suffix"): {"enum": [None]},  # "Suffix is not supported": only null passes
    }


def tgi_as_served(document: dict, info: dict) -> dict:
    """TGI's document plus the responses TGI's router gives and the document omits, and the requests TGI
    (serde, then validation under the server's limits in `info`, its GET /info) accepts where the document
    says otherwise. Each change says why."""
    _serde_values(document)
    schemas = document["components"]["schemas"]
    for (name, field), bounds in _bounds(info).items():
        schema = schemas[name]["properties"][field]
        schema.update(bounds)
        if "format" in bounds and bounds["format"] is None:
            del schema["format"]
    # Validation refuses empty inputs and more than max_input_tokens of them; 60 characters are at most 240
    # UTF-8 bytes, so at most 240 tokens. /tokenize takes any (it does not validate).
    for name in ("GenerateRequest", "CompatGenerateRequest"):
        schemas[name]["properties"]["inputs"].update({"minLength": 1, "maxLength": 60})
    # best_of > 1 needs sampling and no seed (the rule names do_sample; temperature & co. would do too)
    schemas["GenerateParameters"]["anyOf"] = [
        {"properties": {"best_of": {"type": "integer", "maximum": 1, "nullable": True}}},
        {
            "required": ["do_sample"],
            "properties": {
                "do_sample": {"type": "boolean", "enum": [True]},
                "seed": {"enum": [None], "nullable": True},
            },
        },
    ]
    # A message needs `content` or `tool_calls` (serde: "did not match any variant of untagged enum
    # MessageBody"); schemathesis would build its example from the property examples, which have neither.
    schemas["Message"]["example"] = {"role": "user", "content": "What is Deep Learning?"}
    for part in schemas["Message"]["allOf"]:
        for field in part.get("properties", {}).values():
            field.pop("example", None)
    # SagemakerRequest is serde's untagged enum: the first variant that deserializes wins (a GenerateRequest
    # ignores unknown fields, so `{"inputs": ..., "messages": [...]}` is a generate request), not `oneOf`
    schemas["SagemakerRequest"]["anyOf"] = schemas["SagemakerRequest"].pop("oneOf")
    # /invocations answers an `inputs` request as POST / does: a one-element array
    one_generation = {"type": "array", "items": {"$ref": "#/components/schemas/GenerateResponse"}, "minItems": 1}
    schemas["SagemakerResponse"]["oneOf"][0] = one_generation
    # A named tool_choice (`{"type": "function", "function": {"name": N}}`: serde's tag is required too)
    # must name one of `tools`, else TGI answers a 422 tool error; a schema cannot tie the two fields,
    # so the soak sends only "auto", "none" and "required".
    schemas["ToolChoice"]["oneOf"] = [choice for choice in schemas["ToolChoice"]["oneOf"] if "enum" in choice]
    # response_format and tools together are a 422 tool error ("Grammar and tools are mutually exclusive",
    # even for `tools: []`); null is their absence
    schemas["ChatRequest"]["not"] = {
        "required": ["tools", "response_format"],
        "properties": {"tools": {"type": "array"}, "response_format": {"type": "object"}},
    }
    # `stream_options` is `#[serde(default)] StreamOptions`, not an Option: TGI refuses `null` with a 422.
    schemas["ChatRequest"]["properties"]["stream_options"].pop("nullable", None)
    # TGI's Prompt deserializer takes a string or a non-empty array ("Empty array detected ..." is a 422).
    # (and validation refuses an empty one, and more than --max-client-batch-size of them)
    prompt = {"type": "string", "minLength": 1, "maxLength": 60}
    many = {"type": "array", "items": prompt, "minItems": 1, "maxItems": info["max_client_batch_size"]}
    schemas["Prompt"] = {"anyOf": [prompt, many]}
    document["paths"]["/"]["get"] = HEALTH
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if method == "post":
                for status, description in AXUM_REJECTIONS.items():
                    response = responses.setdefault(status, {"description": description})
                    response.setdefault("content", {})["text/plain"] = {"schema": {"type": "string"}}
            if path in ("/tokenize", "/chat_tokenize"):
                # tokenizer, template and tool errors: TGI's JSON 422 (`Input validation error`, `template_error`)
                responses["422"]["content"]["application/json"] = {"schema": ERROR_RESPONSE}
            for response in responses.values():
                stream = response.get("content", {}).get("text/event-stream")
                if stream is not None and "schema" in stream:
                    stream["itemSchema"] = sse_events(stream.pop("schema"), _stream_errors(path))
            if path == "/v1/models":
                responses["200"]["content"]["application/json"]["schema"] = MODEL_LIST
    return document
