"""The Llama-3 tokenizer rebuilt from quicktok-v1's vocabulary (used for the GPU benchmark model)."""

import pytest
from transformers import AutoTokenizer

from benchmarks.llama3_tokenizer import quicktok_data_dir, read_ranks, reference_encode, write_llama3_tokenizer
from benchmarks.workload import read_sharegpt_pairs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A fresh build (not the cached copy the other tests get)."""
    out = tmp_path_factory.mktemp("llama3-tokenizer")
    write_llama3_tokenizer(out, cached=False)
    return out


@pytest.fixture(scope="module")
def llama3(built):
    return AutoTokenizer.from_pretrained(built)


def test_the_cached_copy_is_the_build(built, tmp_path):
    write_llama3_tokenizer(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in built.iterdir())
    assert all((tmp_path / p.name).read_bytes() == p.read_bytes() for p in built.iterdir())


def test_vocabulary_and_special_tokens(llama3):
    assert len(llama3) == 128_256
    assert llama3.bos_token_id == 128_000 and llama3.eos_token_id == 128_001
    assert llama3.convert_tokens_to_ids("<|eot_id|>") == 128_009
    # Llama-3's well-known ids; BOS is prepended like Meta's tokenizer.json does.
    assert llama3("hello world").input_ids == [128_000, 15_339, 1_917]
    assert llama3.decode(llama3("Grüße, 世界!").input_ids, skip_special_tokens=True) == "Grüße, 世界!"


def test_matches_tiktoken_algorithm_on_sharegpt_and_hard_words(llama3):
    ranks = read_ranks(quicktok_data_dir() / "llama3.vocab")
    # Words on which a greedy encoder differs from rank-ordered BPE, plus real conversations.
    texts = [" Yıldırım", " zákazníkom", " obepínající", " 스타벅스는"]
    texts += [text[:2000] for pair in read_sharegpt_pairs()[:60] for text in pair]
    ours = llama3(texts, add_special_tokens=False).input_ids
    mismatches = [t[:40] for t, ids in zip(texts, ours) if ids != reference_encode(t, ranks)]
    assert mismatches == []
