"""Real clients against the real server (session `server` fixture): the official `openai` client,
huggingface_hub's InferenceClient.chat_completion and LangChain's ChatHuggingFace.

Greedy (temperature 0) everywhere, so the embedded SmolLM2 gives exact, known texts.
"""

from __future__ import annotations

import openai
import pytest
from huggingface_hub import InferenceClient

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."  # 7 tokens, then <|im_end|>
PROMPT_TOKENS = 37  # SmolLM2's template adds its default system prompt
COMPLETION_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hub(base_url) -> InferenceClient:
    return InferenceClient(base_url=base_url, timeout=300)


def streamed_with_usage(create, **fields) -> list:
    """Every chunk of a greedy stream that ends with its usage chunk; `create`: the client's chat or completions."""
    return list(create(model="tgi", temperature=0, stream=True, stream_options={"include_usage": True}, **fields))


def test_openai_chat(oai):
    response = oai.chat.completions.create(model="tgi", messages=QUESTION, temperature=0, max_tokens=12)
    choice = response.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", ANSWER, "stop")
    assert (response.id, response.object, response.system_fingerprint) == ("", "chat.completion", "3.3.6-dev0-native")
    assert response.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (PROMPT_TOKENS, 8, PROMPT_TOKENS + 8)


def test_openai_chat_stream_with_usage(oai):
    chunks = streamed_with_usage(oai.chat.completions.create, messages=QUESTION, max_tokens=12)
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content for c in token_chunks) == ANSWER
    assert all(c.choices[0].delta.role == "assistant" and c.usage is None for c in token_chunks)
    assert [c.choices[0].finish_reason for c in token_chunks][-2:] == [None, "stop"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8


def test_openai_completions(oai):
    response = oai.completions.create(
        model="tgi", prompt=[COMPLETION_PROMPT, "Paris is the capital of"], temperature=0, max_tokens=3
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text == " Paris.\n"
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 6
    assert response.choices[0].model_extra["sentence_length"] == 3


def test_openai_completions_stream_with_usage(oai):
    chunks = streamed_with_usage(oai.completions.create, prompt=COMPLETION_PROMPT, max_tokens=3)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " Paris.\n"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == ["", "", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_openai_error_is_raised_as_unprocessable(oai):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oai.completions.create(model="tgi", prompt="x", suffix="y")
    assert caught.value.body == "Suffix is not supported and can be achieved by preprocessing the prompt."


def test_hub_chat_completion(hub):
    output = hub.chat_completion(QUESTION, temperature=0, max_tokens=12)
    assert output.choices[0].message.content == ANSWER
    assert output.choices[0].finish_reason == "stop"
    assert output.usage.prompt_tokens == PROMPT_TOKENS


def test_hub_chat_completion_stream(hub):
    chunks = list(
        hub.chat_completion(QUESTION, temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage.total_tokens == PROMPT_TOKENS + 8


def test_langchain_chat_huggingface(base_url):
    from langchain_core.messages import HumanMessage
    from langchain_huggingface import ChatHuggingFace, HuggingFaceEndpoint

    # ChatHuggingFace inherits a falsy temperature only when both are 0.0 (else it samples at 0.8).
    llm = HuggingFaceEndpoint(endpoint_url=base_url, max_new_tokens=12, temperature=0.0)
    chat = ChatHuggingFace(llm=llm, temperature=0.0)
    message = chat.invoke([HumanMessage(content=QUESTION[0]["content"])])
    assert message.content == ANSWER
    assert message.response_metadata["finish_reason"] == "stop"
    assert message.usage_metadata == {
        "input_tokens": PROMPT_TOKENS,
        "output_tokens": 8,
        "total_tokens": PROMPT_TOKENS + 8,
    }
    streamed = "".join(chunk.content for chunk in chat.stream(QUESTION[0]["content"]))
    assert streamed == ANSWER
