"""The API's prompt encoder: the Rust fast path gives exactly the ids transformers gives."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from transformers import AutoTokenizer

from benchmarks.llama3_tokenizer import write_llama3_tokenizer
from tgi_compat.api.serving import tokenization
from tgi_compat.api.serving.tokenization import TokenizerService

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing newline\n",
    "Grüße, 世界! 🎉 naïve café",
    "<|im_start|>user\nhello<|im_end|>\n<|begin_of_text|>tags stay special",
    "x" * 3000 + " words " * 500,
    " ",
]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama3-tokenizer")
    write_llama3_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("name", ["smollm2", "llama3"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_fast_encode_gives_transformers_ids(name, add_special_tokens, smollm2_tokenizer, request):
    tokenizer = smollm2_tokenizer if name == "smollm2" else request.getfixturevalue("llama3")
    service = TokenizerService(tokenizer, workers=1)
    assert service._raw_encode is not None  # the fast path is the one under test
    for text in TEXTS:
        expected = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert service.encode_sync(text, add_special_tokens) == expected, text[:40]
    service.shutdown()


def test_a_truncating_backend_keeps_the_transformers_path(llama3):
    tokenizer = copy.deepcopy(llama3)
    tokenizer._tokenizer.enable_truncation(4)  # e.g. a tokenizer.json saved with truncation on
    service = TokenizerService(tokenizer, workers=1)
    assert service._raw_encode is None
    text = TEXTS[0]
    assert service.encode_sync(text) == llama3(text)["input_ids"]  # transformers turns truncation off per call
    service.shutdown()


async def test_concurrent_prompts_get_their_own_ids(llama3):
    service = TokenizerService(llama3, workers=2)
    texts = [f"{TEXTS[i % len(TEXTS)]} request {i}" for i in range(24)]
    specials = [i % 3 != 0 for i in range(24)]
    got = await asyncio.gather(*(service.encode(t, s) for t, s in zip(texts, specials)))
    assert got == [llama3(t, add_special_tokens=s)["input_ids"] for t, s in zip(texts, specials)]
    service.shutdown()


@pytest.mark.parametrize("cores", [16, 3])
async def test_prompts_queued_behind_a_busy_worker_are_encoded_together_up_to_one_per_core(llama3, cores, monkeypatch):
    monkeypatch.setattr(tokenization, "_CORES", cores)
    service = TokenizerService(llama3, workers=1)
    encode_batch = service._raw_encode
    assert encode_batch is not None
    batch_sizes = []

    def recording(texts, add_special_tokens):
        if not batch_sizes:  # the first call holds the only worker until every other prompt queued
            deadline = time.monotonic() + 10
            while len(service._queued) + len(texts) < 10 and time.monotonic() < deadline:
                time.sleep(0.001)
        batch_sizes.append(len(texts))
        return encode_batch(texts, add_special_tokens=add_special_tokens)

    service._raw_encode = recording
    texts = [f"prompt number {i}" for i in range(10)]
    got = await asyncio.gather(*(service.encode(t) for t in texts))
    assert got == [llama3(t)["input_ids"] for t in texts]
    assert sum(batch_sizes) == 10 and max(batch_sizes) <= cores
    if cores == 16:  # the first call, then everyone queued behind it
        assert len(batch_sizes) == 2
    else:
        assert max(batch_sizes[1:]) == cores
    service.shutdown()


async def test_a_failing_prompt_fails_alone(llama3):
    service = TokenizerService(llama3, workers=1)
    encode_batch = service._raw_encode
    assert encode_batch is not None

    def failing_on_poison(texts, add_special_tokens):
        if "poison" in texts:
            raise ValueError("cannot encode poison")
        return encode_batch(texts, add_special_tokens=add_special_tokens)

    service._raw_encode = failing_on_poison
    results = await asyncio.gather(*(service.encode(t) for t in ["a", "poison", "b"]), return_exceptions=True)
    assert results[0] == llama3("a")["input_ids"] and results[2] == llama3("b")["input_ids"]
    assert isinstance(results[1], ValueError)
    service.shutdown()
