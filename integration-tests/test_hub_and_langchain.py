"""huggingface_hub.InferenceClient.text_generation and LangChain's two TGI wrappers, unchanged."""

from __future__ import annotations

import pytest
from harness import CHAT_PROMPT
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HubValidationError

ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def hub(base_url) -> InferenceClient:
    return InferenceClient(base_url=base_url, timeout=300)


def test_hub_plain_text_gets_the_prompt_prepended_on_post_root(hub):
    # The hub client sends no return_full_text: TGI's compat default (true) applies on POST /.
    assert hub.text_generation(CHAT_PROMPT, max_new_tokens=10) == CHAT_PROMPT + ANSWER
    assert hub.text_generation(CHAT_PROMPT, max_new_tokens=10, return_full_text=False) == ANSWER


def test_hub_details(hub):
    output = hub.text_generation(CHAT_PROMPT, max_new_tokens=10, details=True, return_full_text=False)
    assert output.generated_text == ANSWER
    assert output.details.finish_reason == "eos_token"
    assert output.details.generated_tokens == len(output.details.tokens)
    assert output.details.tokens[-1].special


def test_hub_stream_yields_token_texts_with_specials(hub):
    texts = list(hub.text_generation(CHAT_PROMPT, max_new_tokens=10, stream=True))
    assert "".join(texts) == ANSWER + "<|im_end|>"
    events = list(hub.text_generation(CHAT_PROMPT, max_new_tokens=10, stream=True, details=True))
    assert events[-1].details.finish_reason == "eos_token"
    assert events[-1].details.input_length > 0
    assert events[-1].generated_text == CHAT_PROMPT + ANSWER  # compat default on the stream too


def test_hub_validation_errors(hub):
    with pytest.raises(HubValidationError, match="`temperature` must be strictly positive"):
        hub.text_generation(CHAT_PROMPT, max_new_tokens=2, temperature=0.0)
    with pytest.raises(HubValidationError, match="`top_p` must be > 0.0 and < 1.0"):
        list(hub.text_generation(CHAT_PROMPT, max_new_tokens=2, top_p=1.0, stream=True))


def _first_word_stop(text: str) -> str:
    words = text.split(" ")
    assert len(words) > 2, text
    return " " + words[2]


def test_langchain_community_tgi_wrapper(base_url):
    """Its defaults sample (temperature 0.8, top_p/typical_p 0.95; None is replaced by them), so a
    fixed seed makes invoke and stream comparable."""
    from langchain_community.llms import HuggingFaceTextGenInference

    llm = HuggingFaceTextGenInference(inference_server_url=base_url, max_new_tokens=10, seed=42, timeout=300)
    text = llm.invoke(CHAT_PROMPT)
    assert text and "".join(llm.stream(CHAT_PROMPT)) == text.removesuffix("<|im_end|>")  # stream drops specials
    stop = _first_word_stop(text)
    assert llm.invoke(CHAT_PROMPT, stop=[stop]) == text[: text.index(stop)]  # LangChain cuts the stop away


def test_langchain_huggingface_endpoint(base_url):
    from langchain_huggingface import HuggingFaceEndpoint

    llm = HuggingFaceEndpoint(endpoint_url=base_url, max_new_tokens=10, seed=42, timeout=300)
    text = llm.invoke(CHAT_PROMPT)
    assert text and "".join(llm.stream(CHAT_PROMPT)).removesuffix("<|im_end|>") == text
    stop = _first_word_stop(text)
    assert llm.invoke(CHAT_PROMPT, stop=[stop]) == text[: text.index(stop)]


def test_langchain_huggingface_endpoint_greedy(base_url):
    from langchain_huggingface import HuggingFaceEndpoint

    llm = HuggingFaceEndpoint(
        endpoint_url=base_url, max_new_tokens=10, temperature=None, top_p=None, typical_p=None, timeout=300
    )
    assert llm.invoke(CHAT_PROMPT) == ANSWER
