"""Chat `tools` and `response_format` over the in-memory app: TGI's prompt injection, tool grammar,
`tool_calls` shapes (streamed and not) and the `no_tool` re-run. The scripted engine answers what a
constrained model would; the real engine's masks are tested in tests/router/test_grammar.py."""

from __future__ import annotations

import json
import re

import pytest
from scripted_engine import ScriptedEngine

from tgi_compat.api.serving.chat.tools import DEFAULT_TOOL_PROMPT, StreamSignal, ToolDelta, ToolStream
from tgi_compat.router.request import GrammarKind

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["location"],
        },
    },
}
CALL = '{"function": {"_name": "get_weather", "location": "Paris", "unit": "celsius"}}'


class AnswerEach(ScriptedEngine):
    """The i-th request gets answers[i] (the last one repeats)."""

    def __init__(self, tokenizer, answers: list[str]) -> None:
        self.answers = [tokenizer.encode_sync(a, add_special_tokens=False) for a in answers]
        super().__init__(self.answers[0], max_total_tokens=512)

    def _events(self, request):
        self.continuation = self.answers[min(len(self.requests), len(self.answers)) - 1]
        return super()._events(request)


async def post(make_client, engine, body):
    async with make_client(engine) as http:
        return await http.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, **body})


CALL_ID = re.compile(r"call_[0-9a-f]{24}")


async def test_named_tool_call_shape_prompt_and_grammar(make_client, tokenizer):
    engine = AnswerEach(tokenizer, [CALL])
    response = await post(make_client, engine, {"tools": [WEATHER], "tool_choice": "get_weather"})
    choice = response.json()["choices"][0]
    call_id = choice["message"]["tool_calls"][0]["id"]
    assert CALL_ID.fullmatch(call_id)  # TGI says "0"; OpenAI and vLLM give unique ids
    assert choice == {
        "index": 0,
        "message": {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "description": None,
                        "name": "get_weather",
                        "arguments": '{"location":"Paris","unit":"celsius"}',
                    },
                }
            ],
        },
        "logprobs": None,
        "finish_reason": "stop",
    }
    (request,) = engine.requests
    grammar = json.loads(request.grammar.value)
    assert request.grammar.kind is GrammarKind.JSON_SCHEMA
    assert grammar["properties"] == {"function": {"anyOf": [{"$ref": "#/$functions/get_weather"}]}}
    assert grammar["$functions"]["get_weather"] == {
        "description": "Get the weather",
        "additionalProperties": False,
        "properties": {
            "_name": {"type": "string", "const": "get_weather"},
            "location": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["_name", "location"],
    }


async def test_tool_call_ids_are_unique_across_requests(make_client, tokenizer):
    engine = AnswerEach(tokenizer, [CALL])
    body = {"tools": [WEATHER], "tool_choice": "required"}
    ids = [(await post(make_client, engine, body)).json()["choices"][0]["message"]["tool_calls"][0]["id"]]
    for _ in range(2):
        chunks = sse_chunks((await post(make_client, engine, {**body, "stream": True})).text)
        ids.append(chunks[0]["choices"][0]["delta"]["tool_calls"][0]["id"])
    ids.append((await post(make_client, engine, body)).json()["choices"][0]["message"]["tool_calls"][0]["id"])
    assert len(set(ids)) == 4 and all(CALL_ID.fullmatch(i) for i in ids)


async def test_chat_tokenize_shows_the_tools_in_the_prompt(make_client, engine):
    async with make_client(engine) as http:
        body = {"messages": MESSAGES, "tools": [WEATHER]}
        templated = (await http.post("/chat_tokenize", json=body)).json()["templated_text"]
    tools_json = (
        '[{"type":"function","function":{"description":"Get the weather","name":"get_weather","arguments":'
        + json.dumps(json.dumps(WEATHER["function"]["parameters"], separators=(",", ":")))
        + '}},{"type":"function","function":{"description":"Open ended response with no specific tool selected",'
        '"name":"no_tool","arguments":"{\\"type\\":\\"object\\"}"}}]'
    )
    expected_user = MESSAGES[0]["content"] + "\n---\n" + tools_json + "\n" + DEFAULT_TOOL_PROMPT
    assert f"<|im_start|>user\n{expected_user}<|im_end|>" in templated


async def test_no_tool_answers_again_in_plain_text(make_client, tokenizer):
    engine = AnswerEach(tokenizer, ['{"function": {"_name": "no_tool"}}', " It is sunny."])
    response = await post(make_client, engine, {"tools": [WEATHER]})
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": " It is sunny."}
    first, second = engine.requests
    assert first.grammar is not None and second.grammar is None
    assert len(second.prompt_ids) < len(first.prompt_ids)  # no tools in the second prompt


async def test_unparsable_tool_answer_is_a_tool_error(make_client, tokenizer):
    response = await post(
        make_client, AnswerEach(tokenizer, [" Paris"]), {"tools": [WEATHER], "tool_choice": "required"}
    )
    assert response.status_code == 422
    assert response.json() == {
        "error": 'Tool error: Failed to parse generated text: expected value at line 1 column 2 " Paris"',
        "error_type": "tool_error",
    }


def sse_chunks(text: str) -> list:
    events = [line.removeprefix("data:") for line in text.split("\n\n") if line.startswith("data:")]
    assert events[-1] == " [DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_streamed_tool_call_reassembles(make_client, tokenizer):
    engine = AnswerEach(tokenizer, [CALL])
    body = {"tools": [WEATHER], "tool_choice": "required", "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks((await post(make_client, engine, body)).text)
    *calls, usage = chunks
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in calls]
    assert deltas[0] == {
        "index": 0,
        "id": deltas[0]["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{"},
    }
    assert CALL_ID.fullmatch(deltas[0]["id"]) and {d["id"] for d in deltas} == {deltas[0]["id"]}
    assert all(d["function"]["name"] is None for d in deltas[1:])
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"location": "Paris", "unit": "celsius"}
    assert all(c["choices"][0]["finish_reason"] is None for c in calls)  # TGI sends no finish chunk for tools
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0


async def test_streamed_no_tool_restarts_as_plain_text(make_client, tokenizer):
    engine = AnswerEach(tokenizer, ['{"function": {"_name": "no_tool"}}', " It is sunny."])
    chunks = sse_chunks((await post(make_client, engine, {"tools": [WEATHER], "stream": True})).text)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == " It is sunny."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("response_format", "kind", "value"),
    [
        ({"type": "json_object"}, GrammarKind.ANY_JSON, ""),
        ({"type": "json_object", "schema": {"properties": {"a": {"type": "integer"}}}}, GrammarKind.JSON_SCHEMA, '{"properties":{"a":{"type":"integer"}}}'),
        ({"type": "regex", "value": "[0-9]+"}, GrammarKind.REGEX, "[0-9]+"),
    ],
)  # fmt: skip
async def test_response_format_shapes(make_client, engine, response_format, kind, value):
    response = await post(make_client, engine, {"response_format": response_format})
    assert response.status_code == 200
    assert (engine.requests[-1].grammar.kind, engine.requests[-1].grammar.value) == (kind, value)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("json_schema", "expected"),
    [
        ({"name": "A", "schema": SCHEMA, "strict": True}, (GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":")), True)),
        ({"name": "A", "schema": SCHEMA}, (GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":")), True)),
        ({"name": "A", "schema": SCHEMA, "strict": False}, (GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":")), False)),
        ({"name": "A"}, (GrammarKind.ANY_JSON, "", True)),
    ],
)  # fmt: skip
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_openai_json_schema_response_format(make_client, engine, json_schema, expected, route):
    """OpenAI's structured outputs (the openai SDK's `.parse()`): the schema under `json_schema.schema`."""
    prompt = {"messages": MESSAGES} if route == "/v1/chat/completions" else {"prompt": "JSON:"}
    body = {**prompt, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": json_schema}}
    async with make_client(engine) as http:
        response = await http.post(route, json=body)
    assert response.status_code == 200, response.text
    grammar = engine.requests[-1].grammar
    assert (grammar.kind, grammar.value, grammar.strict) == expected


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_openai_json_schema_takes_tgis_checks_and_texts(make_client, engine, route):
    prompt = {"messages": MESSAGES} if route == "/v1/chat/completions" else {"prompt": "JSON:"}
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "A", "schema": {"type": "object"}}}, "grammar is not valid: Grammar must have a 'properties' field"),
        ({"type": "json_schema", "json_schema": {"name": "A", "schema": {"properties": {"a": {"type": "strng"}}}}}, "grammar is not valid: \"strng\" is not valid under any of the schemas listed in the 'anyOf' keyword"),
    ]  # fmt: skip
    async with make_client(engine) as http:
        for response_format, message in cases:
            response = await http.post(route, json={**prompt, "response_format": response_format})
            assert (response.status_code, response.json()) == (
                422,
                {"error": f"Input validation error: {message}", "error_type": "validation"},
            )
        response = await http.post(route, json={**prompt, "response_format": {"type": "json_schema"}})
        assert (response.status_code, response.text) == (
            422,
            "Failed to deserialize the JSON body into the target type: response_format: missing field `value`",
        )
        # TGI's own form wins where a client sends both
        both = {
            "type": "json_schema",
            "value": {"schema": SCHEMA},
            "json_schema": {"name": "A", "schema": {}, "strict": False},
        }
        assert (await http.post(route, json={**prompt, "temperature": 0, "response_format": both})).status_code == 200
    assert engine.requests[-1].grammar.strict


def test_tool_stream_replays_tgi_token_split():
    """TGI's own test tokens: nothing until the name parses, then the arguments piece by piece."""
    tokens = ['{"', "function", '":', ' {"', "_", "name", '":', ' "', "get", "_current", "_weather", '",']
    tokens += [' "', "location", '":', ' "', "San", " Francisco", ",", " CA", '",', ' "', "format", '":', ' "']
    tokens += ["c", "elsius", '"}}']
    stream = ToolStream()
    pieces = [stream.push(t, special=False) for t in tokens]
    assert pieces[:11] == [None] * 11
    assert pieces[11] == ToolDelta("{", name="get_current_weather")
    assert "".join(p.arguments for p in pieces[11:]) == '{ "location": "San Francisco, CA", "format": "celsius"}'
    assert stream.push("<|im_end|>", special=True) is None


def test_tool_stream_edge_cases():
    stream = ToolStream()  # the comma after the name comes as its own token
    pieces = [stream.push(t, False) for t in ['{"function": {"_name": "f"', ",", ' "a": 1', "}}"]]
    assert "".join(p.arguments for p in pieces if p) == '{ "a": 1}'
    stream = ToolStream()  # a tool without arguments
    assert stream.push('{"function": {"_name": "f"}}', False) == ToolDelta("{}", name="f")
    assert ToolStream().push('{"function": {"_name": "no_tool"', False) is StreamSignal.NO_TOOL


async def test_tools_with_no_messages_is_an_error_answer_not_a_500(make_client, engine):
    # Found by the schemathesis soak: the tool prompt went to messages[-1] of an empty list.
    async with make_client(engine) as http:
        response = await http.post("/v1/chat/completions", json={"messages": [], "tools": [WEATHER]})
    assert response.status_code != 500 and response.status_code < 500, response.text
    assert response.status_code == 200 or "error" in response.json()


def test_a_tool_named_empty_is_constrained_to_its_call():
    """TGI resolves "#/$functions/" to the tool named ""; xgrammar read it as `$functions` and let the
    model answer any JSON there (found by the soak: `{"function": [2019673845]}`, then a tool error)."""
    import xgrammar as xgr

    from tgi_compat.api.protocol.grammar import named_empty_function_refs
    from tgi_compat.api.protocol.openai import Tool
    from tgi_compat.api.serving.chat.tools import tool_grammar

    tool = Tool.model_validate({"type": "function", "function": {"name": "", "arguments": None}})
    schema = named_empty_function_refs(tool_grammar([tool]))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    assert xgr.testing._is_grammar_accept_string(grammar, '{"function": {"_name": ""}}')
    assert not xgr.testing._is_grammar_accept_string(grammar, '{"function": [2019673845]}')


def test_references_to_a_tool_named_empty_do_not_copy_it():
    """Many references to one large function stay one copy of it: each reference replaced by the function made a
    181 KB schema a 244 MB grammar (a 2 MB body would have asked for ~40 GB)."""
    from tgi_compat.api.protocol.grammar import grammar_spec
    from tgi_compat.api.protocol.tgi import GrammarType

    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 80} for i in range(1000)}}
    schema = {
        "$functions": {"": big},
        "type": "object",
        "properties": {"a": {"anyOf": [{"$ref": "#/$functions/"}] * 2000}},
    }
    spec = grammar_spec(GrammarType(type="json", value=schema), supported=True)
    assert spec is not None and len(spec.value) < 2 * len(json.dumps(schema))
