"""Structured output against the real server (embedded SmolLM2, xgrammar in the engine process):
raw HTTP grammars (JSON schema, regex), TGI's error texts, bad grammars that must not hurt the
server, and the real clients (openai tools, huggingface_hub, text-generation, LangChain)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from harness import MAX_CONCURRENT_REQUESTS

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
}
JOBS = ["baker", "pilot", "nurse", "farmer", "teacher", "chef"]
PROMPTS = [f"Describe a {job} from Paris as JSON." for job in JOBS]
IPV4 = r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


async def generate_all(http, bodies: list[dict]) -> list[dict]:
    """Concurrently, within the server's --max-concurrent-requests."""
    gate = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)

    async def one(body):
        async with gate:
            response = await http.post("/generate", json=body)
            assert response.status_code == 200, response.text
            return response.json()

    return await asyncio.gather(*(one(body) for body in bodies))


# ------------------------------------------------------------------------------------ raw HTTP


async def test_json_schema_prompts_greedy_and_seeded(http):
    grammar = {"type": "json", "value": PERSON}
    greedy = {"max_new_tokens": 160, "grammar": grammar, "details": True}
    seeded = {**greedy, "do_sample": True, "temperature": 0.7}
    bodies = [{"inputs": chat(p), "parameters": greedy} for p in PROMPTS]
    bodies += [{"inputs": chat(p), "parameters": {**seeded, "seed": i}} for i, p in enumerate(PROMPTS)]
    for body, answer in zip(bodies, await generate_all(http, bodies)):
        assert answer["details"]["finish_reason"] == "eos_token", (body, answer)
        jsonschema.validate(json.loads(answer["generated_text"]), PERSON)
    # a seed reproduces its answer
    again = await generate_all(http, bodies[-1:])
    assert again[0]["generated_text"] == (await generate_all(http, bodies[-1:]))[0]["generated_text"]


async def test_regex_prompts(http):
    cases = [("What is the IP address of the local router?", IPV4), ("What is the IP of a DNS server?", IPV4)]
    cases += [("When was the Eiffel Tower finished?", DATE), ("What is today's date?", DATE)]
    bodies = [
        {"inputs": chat(q), "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": regex}}}
        for q, regex in cases
    ]
    for (question, regex), answer in zip(cases, await generate_all(http, bodies)):
        assert re.fullmatch(regex, answer["generated_text"]), (question, answer)


ERRORS = [
    ({"type": "json", "value": {"type": "object"}}, "grammar is not valid: Grammar must have a 'properties' field"),
    ({"type": "json", "value": "{oops"}, "grammar is not valid: key must be a string at line 1 column 2"),
    ({"type": "json", "value": 3}, "grammar is not supported"),
    (
        {"type": "json", "value": {"properties": {"a": {"type": "strng"}}}},
        "grammar is not valid: \"strng\" is not valid under any of the schemas listed in the 'anyOf' keyword",
    ),
    ({"type": "regex", "value": "(a"}, "grammar is not valid: Regex parsing error at position 3: The parenthesis is not closed."),
]  # fmt: skip


@pytest.mark.parametrize(("grammar", "message"), ERRORS)
async def test_error_texts_byte_for_byte(http, grammar, message):
    body = {"inputs": chat("Hi"), "parameters": {"max_new_tokens": 5, "grammar": grammar}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 422
    assert (
        response.content
        == json.dumps(
            {"error": f"Input validation error: {message}", "error_type": "validation"}, separators=(",", ":")
        ).encode()
    )
    stream = await http.post("/generate_stream", json=body)
    assert stream.status_code == 200
    assert (
        stream.text
        == f"data:{json.dumps({'error': f'Input validation error: {message}', 'error_type': 'validation'}, separators=(',', ':'))}\n\n"
    )


async def test_bad_grammars_never_hurt_the_server(http):
    deep: dict = {"type": "string"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    # 150 properties of 40 values: seconds in the compile process (xgrammar's JSON of the grammar grows with the
    # square of the properties: 300 took 18 s), far longer than the plain request's whole life
    huge = {
        "type": "object",
        "properties": {f"field_{i}": {"enum": [f"v{i}_{j}" for j in range(40)]} for i in range(150)},
    }
    endless = {"type": "object", "properties": {"a": {"type": "string", "minLength": 400}}, "required": ["a"]}

    async def post(grammar, max_new_tokens=6):
        body = {"inputs": chat("JSON please"), "parameters": {"max_new_tokens": max_new_tokens, "grammar": grammar}}
        return await http.post("/generate", json=body)

    plain = {"inputs": chat("What is the capital of France?"), "parameters": {"max_new_tokens": 3}}
    finished: list[str] = []

    async def tracked(name, call):
        response = await call
        finished.append(name)
        return response

    # a huge schema compiling does not hold up a plain request sent right after it
    huge_response, plain_response = await asyncio.gather(
        tracked("huge", post({"type": "json", "value": huge})), tracked("plain", http.post("/generate", json=plain))
    )
    assert plain_response.status_code == 200 and finished[0] == "plain"
    assert huge_response.status_code in (200, 422), huge_response.text
    deep_response = await post({"type": "json", "value": deep})
    assert deep_response.status_code in (200, 422), deep_response.text
    if deep_response.status_code == 422:
        assert deep_response.json()["error_type"] == "validation"
    never = await post({"type": "json", "value": endless}, max_new_tokens=8)
    body = await http.post(
        "/generate",
        json={
            "inputs": chat("JSON please"),
            "parameters": {"max_new_tokens": 8, "details": True, "grammar": {"type": "json", "value": endless}},
        },
    )
    assert never.status_code == 200 and body.json()["details"]["finish_reason"] == "length"
    assert body.json()["generated_text"].startswith('{"a": "')
    assert (await http.get("/health")).status_code == 200
    assert (await http.post("/generate", json=plain)).status_code == 200


async def test_extreme_parameters_never_leave_the_grammar(http):
    # f32 makes 1e39 inf, and 1e-45 is its smallest positive value (TGI accepts both; 1e-46 is 0, a 422):
    # scores divided by it overflow to inf. NaN and +inf scores chose token 0 (found by the 20-minute soak)
    extremes = [
        {"do_sample": True, "temperature": 1e-45, "seed": 2},
        {"repetition_penalty": 1e-45, "top_n_tokens": 2},
        {"do_sample": True, "temperature": 1e39, "best_of": 2},
    ]
    grammar = {"type": "regex", "value": DATE}
    bodies = [
        {"inputs": chat("A date?"), "parameters": {"max_new_tokens": 16, "details": True, "grammar": grammar, **p}}
        for p in extremes
    ]
    responses = await asyncio.gather(*(http.post("/generate", json=body) for body in bodies))
    for parameters, response in zip(extremes, responses):
        assert response.status_code == 200, response.text
        details = response.json()["details"]
        answers = [(response.json()["generated_text"], details["finish_reason"])]
        answers += [(s["generated_text"], s["finish_reason"]) for s in details.get("best_of_sequences", [])]
        assert len(answers) == parameters.get("best_of", 1)
        for text, finish_reason in answers:
            assert finish_reason == "eos_token" and re.fullmatch(DATE, text), (parameters, text, finish_reason)


# ------------------------------------------------------------------------------------ clients


@pytest.fixture(scope="module")
def oai(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def assert_weather_arguments(arguments: str) -> None:
    assert {"location", "unit"} <= json.loads(arguments).keys()


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_openai_tools(oai, tool_choice):
    response = oai.chat.completions.create(
        model="tgi", messages=WEATHER_QUESTION, tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=60
    )
    (call,) = response.choices[0].message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert re.fullmatch("call_[0-9a-f]{24}", call.id)
    assert_weather_arguments(call.function.arguments)
    stream = oai.chat.completions.create(
        model="tgi",
        messages=WEATHER_QUESTION,
        tools=[WEATHER],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    deltas = [
        chunk.choices[0].delta.tool_calls[0] for chunk in stream if chunk.choices and chunk.choices[0].delta.tool_calls
    ]
    assert deltas[0].function.name == "get_weather"
    assert {d.id for d in deltas} == {deltas[0].id} and deltas[0].id != call.id
    streamed = "".join(d.function.arguments for d in deltas)
    assert json.loads(streamed) == json.loads(call.function.arguments)


def test_openai_tools_auto(oai):
    """`auto` offers `no_tool` too: either a call with the required keys or a plain answer."""
    for stream in (False, True):
        response = oai.chat.completions.create(
            model="tgi", messages=WEATHER_QUESTION, tools=[WEATHER], temperature=0, max_tokens=60, stream=stream
        )
        if stream:
            chunks = [c for c in response if c.choices]
            calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
            if calls:
                assert_weather_arguments("".join(d.function.arguments for d in calls))
            else:
                assert "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            message = response.choices[0].message
            if message.tool_calls:
                assert_weather_arguments(message.tool_calls[0].function.arguments)
            else:
                assert message.content


def test_openai_response_format(oai):
    response = oai.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": "Describe a pilot as JSON."}],
        response_format={"type": "json_object", "value": PERSON},
        temperature=0,
        max_tokens=120,
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)


def test_hub_chat_completion_tools_and_response_format(base_url):
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=base_url, timeout=300)
    output = hub.chat_completion(
        WEATHER_QUESTION, tools=[WEATHER], tool_choice="get_weather", temperature=0, max_tokens=60
    )
    call = output.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    arguments = call.function.arguments
    assert {"location", "unit"} <= (json.loads(arguments) if isinstance(arguments, str) else arguments).keys()
    output = hub.chat_completion(
        [{"role": "user", "content": "Describe a nurse as JSON."}],
        response_format={"type": "json", "value": PERSON},
        temperature=0,
        max_tokens=120,
    )
    jsonschema.validate(json.loads(output.choices[0].message.content), PERSON)
    prompt = chat("What is the IP of the router?")
    grammar = {"type": "regex", "value": IPV4}
    text = hub.text_generation(prompt, max_new_tokens=20, grammar=grammar, return_full_text=False)
    assert re.fullmatch(IPV4, text)
    # The hub client sends no return_full_text; on POST / TGI then defaults it to true for a model whose
    # pipeline tag is text-generation or unknown, so the answer comes back after the prompt.
    assert hub.text_generation(prompt, max_new_tokens=20, grammar=grammar) == prompt + text


def test_text_generation_client_grammar(base_url):
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    client = Client(base_url, timeout=300)
    response = client.generate(
        chat("Describe a chef as JSON."), max_new_tokens=120, grammar=Grammar(type=GrammarType.Json, value=PERSON)
    )
    assert response.details.finish_reason == "eos_token"
    jsonschema.validate(json.loads(response.generated_text), PERSON)


def test_langchain_structured_output_and_tools(base_url):
    from langchain_huggingface import ChatHuggingFace, HuggingFaceEndpoint
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and the country it is in."""

        name: str = Field(max_length=12)
        country: str = Field(max_length=12)

    llm = HuggingFaceEndpoint(endpoint_url=base_url, max_new_tokens=60, temperature=0.0)
    chat_model = ChatHuggingFace(llm=llm, temperature=0.0)
    city = chat_model.with_structured_output(City, method="json_schema").invoke("Name a city in France.")
    City.model_validate(city)
    tool_schema = City.model_json_schema()
    called = chat_model.with_structured_output({"title": "City", "description": "A city", **tool_schema}).invoke(
        "Name a city in France."
    )
    assert {"name", "country"} <= called.keys()
    message = chat_model.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and {"location", "unit"} <= call["args"].keys()
