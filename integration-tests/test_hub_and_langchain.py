"""huggingface_hub.InferenceClient.text_generation and LangChain's two TGI wrappers, unchanged."""

from __future__ import annotations

import pytest
from conftest import CHAT_PROMPT
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


def test_langchain_community_tgi_wrapper(base_url):
    from langchain_community.llms import HuggingFaceTextGenInference

    llm = HuggingFaceTextGenInference(
        inference_server_url=base_url, max_new_tokens=10, temperature=None, top_p=None, typical_p=None, timeout=300
    )
    assert llm.invoke(CHAT_PROMPT) == ANSWER
    assert llm.invoke(CHAT_PROMPT, stop=[" France"]) == "The capital of"  # LangChain cuts the stop away
    chunks = list(llm.stream(CHAT_PROMPT))
    assert "".join(chunks) == ANSWER  # the wrapper drops special tokens in streams


def test_langchain_huggingface_endpoint(base_url):
    from langchain_huggingface import HuggingFaceEndpoint

    llm = HuggingFaceEndpoint(
        endpoint_url=base_url, max_new_tokens=10, temperature=None, top_p=None, typical_p=None, timeout=300
    )
    assert llm.invoke(CHAT_PROMPT) == ANSWER
    chunks = list(llm.stream(CHAT_PROMPT))
    assert "".join(chunks).startswith(ANSWER)


def test_langchain_sampling_defaults_work(base_url):
    """The wrappers' own defaults (temperature 0.8, top_p/typical_p 0.95) are valid TGI sampling."""
    from langchain_huggingface import HuggingFaceEndpoint

    llm = HuggingFaceEndpoint(endpoint_url=base_url, max_new_tokens=4, timeout=300)
    assert isinstance(llm.invoke(CHAT_PROMPT), str)
