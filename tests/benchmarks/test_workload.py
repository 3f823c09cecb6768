"""Workload sources: ShareGPT sampling and filter, the stored length list, synthesized prompts."""

import numpy as np
import pytest

from benchmarks.tokenizer import default_model_id, load_tokenizer
from benchmarks.workload import (
    build_workload,
    is_valid_pair,
    read_length_list,
    sample_sharegpt,
    sharegpt_like_lengths,
    synthesize,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_id())


def test_vllm_filter_bounds():
    assert is_valid_pair(4, 4) and is_valid_pair(1024, 1024)
    assert not is_valid_pair(3, 100) and not is_valid_pair(100, 3)
    assert not is_valid_pair(1025, 10) and not is_valid_pair(1024, 1025)


def test_sharegpt_samples_are_filtered_and_counted_with_the_target_tokenizer(tokenizer):
    samples = sample_sharegpt(tokenizer, 40, seed=0)
    assert len(samples) == 40
    for s in samples:
        assert is_valid_pair(s.prompt_len, s.output_len)
        assert s.prompt_len == len(tokenizer(s.prompt).input_ids)
    assert [s.prompt for s in sample_sharegpt(tokenizer, 40, seed=0)] == [s.prompt for s in samples]
    assert [s.prompt for s in sample_sharegpt(tokenizer, 40, seed=1)] != [s.prompt for s in samples]


def test_stored_length_list_matches_the_published_statistics():
    rows = np.array(read_length_list())
    assert len(rows) == 15_502  # of 17,400 two-turn conversations in the shipped (truncated) file
    assert rows[:, 0].mean() == pytest.approx(218.5, abs=0.2)
    assert rows[:, 1].mean() == pytest.approx(200.8, abs=0.2)
    assert all(is_valid_pair(int(p), int(o)) for p, o in rows)


def test_sharegpt_like_generator_is_close_to_the_real_set():
    lengths = np.array(sharegpt_like_lengths(4000, seed=0))
    assert all(is_valid_pair(int(p), int(o)) for p, o in lengths)
    assert lengths[:, 0].mean() == pytest.approx(218.9, rel=0.08)
    assert lengths[:, 1].mean() == pytest.approx(202.5, rel=0.08)
    assert np.corrcoef(np.log(lengths[:, 0]), np.log(lengths[:, 1]))[0, 1] < -0.3


def test_synthesized_prompts_have_exact_lengths_and_no_shared_prefix(tokenizer):
    samples = synthesize(tokenizer, [(4, 5), (100, 7), (1024, 3), (100, 9)], seed=0)
    assert [s.prompt_len for s in samples] == [4, 100, 1024, 100]  # SmolLM2 adds no BOS
    assert [s.output_len for s in samples] == [5, 7, 3, 9]
    assert samples[1].prompt[:20] != samples[3].prompt[:20]


def test_fixed_and_length_list_workloads(tokenizer):
    fixed = build_workload(tokenizer, "fixed", 3, input_len=32, output_len=8)
    assert [(s.prompt_len, s.output_len) for s in fixed] == [(32, 8)] * 3
    stored = build_workload(tokenizer, "sharegpt-lengths", 5, seed=3)
    rows = set(read_length_list())
    assert all((s.prompt_len, s.output_len) in rows for s in stored)
