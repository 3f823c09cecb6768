"""The OpenAI-compatible ecosystem against the real server (embedded SmolLM2): OpenAI's structured outputs
through the `openai` SDK's `.parse()` and pydantic-ai, tool-call ids through pydantic-ai's tool loop, and
what lm-eval's `local-completions` reads (token-id prompts, echoed prompt logprobs with their top-k),
compared with transformers on the same GGUF.

Greedy everywhere, and few tokens: the server shares 2 cores with the rest of the suite.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tests.modeling.helpers import smollm2_reference_model

CALL_ID = re.compile(r"call_[0-9a-f]{24}")
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["pilot", "chef", "nurse"]},
    },
    "required": ["name", "age", "job"],
}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)


# ------------------------------------------------------------------------------- structured output


def test_openai_sdk_parse_with_a_pydantic_model(oai):
    """The SDK sends `{"type": "json_schema", "json_schema": {"name", "schema", "strict": true}}`."""
    completion = oai.chat.completions.parse(
        model="tgi",
        messages=[{"role": "user", "content": "Name a city in France."}],
        response_format=City,
        temperature=0,
        max_tokens=40,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert json.loads(message.content).keys() == {"name", "country"}  # strict: no other keys
    with oai.chat.completions.stream(
        model="tgi",
        messages=[{"role": "user", "content": "Name a city in Spain."}],
        response_format=City,
        temperature=0,
        max_tokens=40,
    ) as stream:
        assert isinstance(stream.get_final_completion().choices[0].message.parsed, City)


def person_format(strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def describe_a_chef(oai, response_format: dict, **fields):
    """A greedy chat asking for a chef as JSON, under `response_format`."""
    messages = [{"role": "user", "content": "Describe a chef as JSON."}]
    return oai.chat.completions.create(
        model="tgi", messages=messages, response_format=response_format, temperature=0, **fields
    )


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_on_chat_and_completions(oai, stream):
    response_format = person_format(strict=True)
    answer = describe_a_chef(oai, response_format, max_tokens=40, stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream else None
    jsonschema.validate(json.loads(text or answer.choices[0].message.content), PERSON)
    completion = oai.completions.create(
        model="tgi",
        prompt=chat("Describe a pilot as JSON."),
        temperature=0,
        max_tokens=40,
        stream=stream,
        extra_body={"response_format": response_format},
    )
    if stream:  # TGI's completion streams show the EOS token's text ("<|im_end|>") in the last chunk
        text = "".join(c.choices[0].text for c in completion if c.choices and c.choices[0].finish_reason != "eos_token")
    else:
        text = completion.choices[0].text
    jsonschema.validate(json.loads(text), PERSON)


def test_strict_false_keeps_the_schema_with_open_objects(oai):
    """README: `strict: false` still constrains to the schema, under JSON Schema's defaults (unlisted keys
    allowed); the small model adds some, and the answer still validates."""
    answer = describe_a_chef(oai, person_format(strict=False), max_tokens=60)
    assert answer.choices[0].finish_reason == "stop"
    document = json.loads(answer.choices[0].message.content)
    jsonschema.validate(document, PERSON)
    assert document.keys() > PERSON["properties"].keys()


def test_a_schema_tgi_refuses_is_refused_with_tgis_text(oai):
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array"}}}
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oai.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": "Hi"}], response_format=response_format
        )
    assert caught.value.body == "Input validation error: grammar is not valid: Grammar must have a 'properties' field"


# ------------------------------------------------------------------------------------- pydantic-ai


@pytest.fixture(scope="module")
def agent_model(base_url):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("tgi", provider=OpenAIProvider(base_url=f"{base_url}/v1", api_key="unused"))


def test_pydantic_ai_native_structured_output(agent_model):
    from pydantic_ai import Agent, NativeOutput

    agent = Agent(agent_model, output_type=NativeOutput(City), model_settings={"temperature": 0.0, "max_tokens": 40})
    assert isinstance(agent.run_sync("Name a city in France.").output, City)


class Weather(BaseModel):
    city: str = Field(max_length=20)
    celsius: int = Field(ge=-50, le=60)


def test_pydantic_ai_tool_loop_gets_a_distinct_id_per_call(agent_model):
    """get_weather, then pydantic-ai's `final_result` output tool, in two requests: two calls with two ids
    (TGI's "0" for both is what made openai-agents merge them into one and loop)."""
    from pydantic_ai import Agent, RunContext, capture_run_messages
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.tools import ToolDefinition

    agent = Agent(agent_model, output_type=Weather, model_settings={"temperature": 0.0, "max_tokens": 40})
    cities: list[str] = []

    async def until_called(ctx: RunContext, tool: ToolDefinition) -> ToolDefinition | None:
        return None if cities else tool  # the small model would call it forever

    @agent.tool_plain(prepare=until_called)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is 21 degrees celsius in {city}."

    with capture_run_messages() as messages:
        result = agent.run_sync("What is the weather in Paris?")
    assert isinstance(result.output, Weather) and cities == ["Paris"]
    calls = [part for message in messages for part in message.parts if isinstance(part, ToolCallPart)]
    assert [call.tool_name for call in calls] == ["get_weather", "final_result"]
    assert len({call.tool_call_id for call in calls}) == 2
    assert all(CALL_ID.fullmatch(call.tool_call_id) for call in calls)


# ----------------------------------------------------------------------------- lm-eval's requests


@pytest.fixture(scope="module")
def reference():
    return smollm2_reference_model()


@pytest.fixture(scope="module")
def tokenizer():
    from tgi_compat.modeling.tokenizer import load_tokenizer

    return load_tokenizer()


def test_a_token_id_prompt_is_its_text(oai, tokenizer):
    text = "The capital of France is"
    ids = tokenizer(text)["input_ids"]
    asked = {"model": "tgi", "temperature": 0, "max_tokens": 4, "echo": True, "logprobs": 2}
    by_text = oai.completions.create(prompt=text, **asked).choices[0]
    by_ids = oai.completions.create(prompt=ids, **asked).choices[0]
    assert by_ids.text == by_text.text and by_text.text.startswith(text)
    ours, theirs = by_ids.logprobs, by_text.logprobs
    assert (ours.tokens, ours.text_offset) == (theirs.tokens, theirs.text_offset)
    assert ours.token_logprobs[1:] == pytest.approx(theirs.token_logprobs[1:], abs=1e-5)
    for mine, other in zip(ours.top_logprobs[1:], theirs.top_logprobs[1:]):
        assert mine.keys() == other.keys() and list(mine.values()) == pytest.approx(list(other.values()), abs=1e-5)
    several = oai.completions.create(prompt=[ids, ids[:3]], **asked).choices
    assert min(several, key=lambda c: c.index).text == by_text.text
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oai.completions.create(model="tgi", prompt=[1, 10**6], max_tokens=1)
    assert (
        caught.value.body == "Input validation error: `prompt` token id 1000000 is outside the vocabulary (size 49152)"
    )


def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row i scores the token at position i + 1."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], clean_up_tokenization_spaces=False)


def test_echoed_top_logprobs_are_the_prefill_top_k(oai, reference, tokenizer):
    ids = tokenizer("Paris is the capital of France. Berlin is the capital of")["input_ids"]
    k = 5
    logprobs = (
        oai.completions.create(model="tgi", prompt=ids, temperature=0, max_tokens=1, echo=True, logprobs=k)
        .choices[0]
        .logprobs
    )
    expected = reference_logprobs(reference, ids)
    assert logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        top = torch.topk(expected[position - 1], k)
        wanted = {token_text(tokenizer, i): v for i, v in zip(top.indices.tolist(), top.values.tolist())}
        wanted.setdefault(token_text(tokenizer, ids[position]), expected[position - 1, ids[position]].item())
        served = logprobs.top_logprobs[position]
        assert served.keys() == wanted.keys(), position
        assert list(served.values()) == pytest.approx([wanted[t] for t in served], abs=1e-3), position
    with oai.completions.create(
        model="tgi", prompt=ids, temperature=0, max_tokens=1, echo=True, logprobs=k, stream=True
    ) as stream:
        echoed = next(iter(stream)).choices[0].logprobs  # a stream's echo chunk carries the same scores
    assert echoed.tokens == logprobs.tokens[: len(ids)]
    assert echoed.top_logprobs[1:] == logprobs.top_logprobs[1 : len(ids)]


MULTIPLE_CHOICE = [  # transformers' greedy choice is among them for three of the four
    ("The capital of France is", [" Paris", " London", " Rome"]),
    ("One, two, three, four,", [" five", " six", " ten"]),
    ("Monday, Tuesday, Wednesday,", [" Thursday", " Friday", " Sunday"]),
    ("The opposite of hot is", [" cold", " warm", " big"]),
]


def is_greedy(logprobs, context_length: int) -> bool:
    """lm-eval's flag on an echoed answer: every continuation token scored as high as its top choice
    (the last entry is the one generated token lm-eval asks for, and ignores)."""
    scored = zip(logprobs.token_logprobs[context_length:-1], logprobs.top_logprobs[context_length:-1])
    return all(logprob >= max(top.values()) for logprob, top in scored)


def test_lm_eval_greedy_flags_match_transformers(oai, reference, tokenizer):
    requests = [
        (tokenizer(context)["input_ids"], tokenizer(choice)["input_ids"])
        for context, choices in MULTIPLE_CHOICE
        for choice in choices
    ]
    served = []
    for batch in (requests[i : i + 4] for i in range(0, len(requests), 4)):  # --max-client-batch-size
        answer = oai.completions.create(
            model="tgi", prompt=[c + a for c, a in batch], temperature=0, max_tokens=1, echo=True, logprobs=1
        )
        choices = sorted(answer.choices, key=lambda choice: choice.index)
        served += [is_greedy(choice.logprobs, len(context)) for choice, (context, _) in zip(choices, batch)]
    expected = []
    for context, continuation in requests:
        ids = context + continuation
        best = reference_logprobs(reference, ids).argmax(dim=-1)[len(context) - 1 : len(ids) - 1]
        expected.append(best.tolist() == continuation)
    assert served == expected
    assert 0 < sum(expected) < len(expected)  # the flag tells answers apart (it was always true)
