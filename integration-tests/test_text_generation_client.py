"""The `text-generation` 0.7 client (Client + AsyncClient; both POST to the base URL `/`)."""

from __future__ import annotations

import asyncio
import re

import pytest
from harness import CHAT_PROMPT, MAX_CONCURRENT_REQUESTS
from text_generation import AsyncClient, Client
from text_generation.errors import OverloadedError, ValidationError


@pytest.fixture(scope="module")
def client(base_url) -> Client:
    return Client(base_url, timeout=300)


@pytest.fixture
def async_client(base_url) -> AsyncClient:
    return AsyncClient(base_url, timeout=300)


def test_generate_greedy_details(client, response_snapshot):
    response = client.generate(CHAT_PROMPT, max_new_tokens=10)
    assert response.generated_text == "The capital of France is Paris."
    details = response.details
    assert details.finish_reason == "eos_token"
    assert details.generated_tokens == len(details.tokens) == 8
    assert details.tokens[-1].special and details.tokens[-1].text == "<|im_end|>"
    assert details.seed is None and details.prefill == []
    assert response.model_dump() == response_snapshot


def test_generate_stream_matches_generate(client):
    tokens = list(client.generate_stream(CHAT_PROMPT, max_new_tokens=10))
    assert [t.token.text for t in tokens][:3] == ["The", " capital", " of"]
    assert all(t.generated_text is None and t.details is None for t in tokens[:-1])
    last = tokens[-1]
    assert last.generated_text == "The capital of France is Paris."
    assert last.details.finish_reason == "eos_token" and last.details.generated_tokens == len(tokens)


def test_stop_sequence_is_kept(client):
    response = client.generate(CHAT_PROMPT, max_new_tokens=10, stop_sequences=[" France"])
    assert response.generated_text == "The capital of France"
    assert response.details.finish_reason == "stop_sequence"


def test_length_limit(client):
    response = client.generate(CHAT_PROMPT, max_new_tokens=3)
    assert response.generated_text == "The capital of"
    assert (response.details.finish_reason, response.details.generated_tokens) == ("length", 3)


def test_top_n_tokens_and_decoder_input_details(client):
    response = client.generate(CHAT_PROMPT, max_new_tokens=2, top_n_tokens=3, decoder_input_details=True)
    details = response.details
    assert len(details.top_tokens) == 2 and all(len(top) >= 3 for top in details.top_tokens)
    assert details.top_tokens[0][0].id == details.tokens[0].id  # greedy picks the top token
    prompt_length = len(details.prefill)
    assert prompt_length > 5 and details.prefill[0].logprob is None
    assert all(token.logprob is not None for token in details.prefill[1:])


def test_seeded_sampling_is_reproducible(client):
    first = client.generate(CHAT_PROMPT, max_new_tokens=6, do_sample=True, seed=1234, temperature=1.5)
    second = client.generate(CHAT_PROMPT, max_new_tokens=6, do_sample=True, seed=1234, temperature=1.5)
    assert first.details.seed == second.details.seed == 1234
    assert first.generated_text == second.generated_text


def test_best_of(client):
    response = client.generate(CHAT_PROMPT, max_new_tokens=4, do_sample=True, best_of=2)
    (other,) = response.details.best_of_sequences
    assert response.details.seed is not None and other.seed is not None
    assert other.generated_tokens == len(other.tokens)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"max_new_tokens": 1000}, "`inputs` tokens + `max_new_tokens` must be <= 512."),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ],
)
def test_validation_errors_raise_validation_error(client, kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        client.generate(CHAT_PROMPT, **kwargs)
    with pytest.raises(ValidationError):
        list(client.generate_stream(CHAT_PROMPT, **kwargs))


async def test_async_client_generate_and_stream(async_client):
    response = await async_client.generate(CHAT_PROMPT, max_new_tokens=10)
    assert response.generated_text == "The capital of France is Paris."
    texts = [token.token.text async for token in async_client.generate_stream(CHAT_PROMPT, max_new_tokens=10)]
    assert "".join(texts) == "The capital of France is Paris.<|im_end|>"
    with pytest.raises(ValidationError):
        await async_client.generate(CHAT_PROMPT, max_new_tokens=10, top_n_tokens=6)


async def test_overload_raises_overloaded_error(async_client):
    calls = [async_client.generate(CHAT_PROMPT, max_new_tokens=6) for _ in range(MAX_CONCURRENT_REQUESTS + 3)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    overloaded = [r for r in results if isinstance(r, OverloadedError)]
    assert overloaded, results
    assert all(isinstance(r, OverloadedError) or r.generated_text for r in results)
