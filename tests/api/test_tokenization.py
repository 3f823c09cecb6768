"""The API's prompt encoder: the Rust fast path gives exactly the ids transformers gives."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from benchmarks.llama3_tokenizer import write_llama3_tokenizer
from tgi_compat.serving.tokenization import TokenizerService

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
