"""Decode and extend attention kernels against their PyTorch references (ragged, GQA, splits)."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.attention.decode import decode_attention, decode_attention_ref
from tgi_compat.kernels.attention.decode_merge import merge_chunk
from tgi_compat.kernels.attention.decode_rotary import NewTokenKV
from tgi_compat.kernels.attention.prefill import prefill_attention, prefill_attention_ref
from tgi_compat.kernels.attention.rotary import rotary_embedding_ref

HEAD_DIM = 16


def make_cache(num_slots: int, num_kv_heads: int, dtype: torch.dtype, gen: torch.Generator):
    k_cache = torch.randn(num_slots, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    return k_cache, v_cache


def make_req_to_token(kv_lens: list[int], num_slots: int, gen: torch.Generator):
    """Rows hold scattered, distinct slots; requests sit in shuffled rows with a spare row unused."""
    max_len = max(kv_lens) + 3
    num_rows = len(kv_lens) + 1
    slots = torch.randperm(num_slots, generator=gen)[: num_rows * max_len]
    req_to_token = slots.view(num_rows, max_len).to(torch.int32)
    req_rows = torch.randperm(num_rows, generator=gen)[: len(kv_lens)]
    return req_to_token, req_rows


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_attention_matches_reference(group: int, num_splits: int):
    gen = torch.Generator().manual_seed(group * 10 + num_splits)
    num_kv_heads = 2
    kv_lens = [1, 17, 40, 5]  # a context of 1, lengths not divisible by the block, fewer tokens than splits
    k_cache, v_cache = make_cache(256, num_kv_heads, torch.float32, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    q = torch.randn(len(kv_lens), num_kv_heads * group, HEAD_DIM, generator=gen)
    kv = torch.tensor(kv_lens)
    out = decode_attention(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25, num_splits, block_n=16)
    ref = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25)
    assert relative_error(out, ref) < 1e-5


def test_decode_attention_half_precision_and_strided_query():
    gen = torch.Generator().manual_seed(7)
    kv_lens = [33, 2]
    k_cache, v_cache = make_cache(128, 2, torch.float16, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 128, gen)
    qkv = torch.randn(2, 8 * HEAD_DIM + 2 * 2 * HEAD_DIM, generator=gen).half()
    q = qkv[:, : 8 * HEAD_DIM].view(2, 8, HEAD_DIM)  # a view into a fused projection, as models pass it
    kv = torch.tensor(kv_lens)
    out = decode_attention(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25, 4, block_n=16)
    ref = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25)
    assert out.dtype == torch.float16
    assert relative_error(out, ref) < 5e-3


@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_attention_matches_reference(group: int):
    gen = torch.Generator().manual_seed(100 + group)
    num_kv_heads = 1 if group == 8 else 2
    q_lens = [5, 1, 23, 1]
    kv_lens = [5, 30, 41, 1]  # fresh prompt, a decode, a chunk over a cached prefix, a 1-token prompt
    k_cache, v_cache = make_cache(256, num_kv_heads, torch.float32, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    q_len_t = torch.tensor(q_lens)
    q_start = torch.cumsum(q_len_t, 0) - q_len_t
    q = torch.randn(sum(q_lens), num_kv_heads * group, HEAD_DIM, generator=gen)
    args = (q, k_cache, v_cache, req_to_token, req_rows, q_start, q_len_t, torch.tensor(kv_lens))
    out = prefill_attention(*args, max_q_len=max(q_lens), scale=0.3, block_m=16, block_n=16)
    ref = prefill_attention_ref(*args, scale=0.3)
    assert relative_error(out, ref) < 1e-5


def test_decode_and_prefill_kernels_agree_on_single_tokens():
    gen = torch.Generator().manual_seed(3)
    kv_lens = [9, 64, 1]
    k_cache, v_cache = make_cache(512, 2, torch.float32, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 512, gen)
    q = torch.randn(3, 8, HEAD_DIM, generator=gen)
    ones, kv = torch.ones(3, dtype=torch.int64), torch.tensor(kv_lens)
    by_decode = decode_attention(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.2, 2, block_n=16)
    by_prefill = prefill_attention(
        q, k_cache, v_cache, req_to_token, req_rows, torch.arange(3), ones, kv, 1, 0.2, block_m=16, block_n=16
    )
    assert relative_error(by_decode, by_prefill) < 1e-5


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [3, 8])
def test_merged_decode_attention_matches_reference_and_leaves_counter_clean(group: int, num_splits: int):
    """Stage 2 folded into stage 1 (last ticket merges); two calls on one counter prove the reset."""
    gen = torch.Generator().manual_seed(200 + group * 10 + num_splits)
    num_kv_heads = 2
    k_cache, v_cache = make_cache(512, num_kv_heads, torch.float32, gen)
    counter = torch.zeros(5, num_kv_heads, dtype=torch.int32)  # more rows than requests, as the backend's
    for kv_lens in ([1, 17, 40, 5], [33, 2, 90, 16]):  # context 1, lengths off the block, fewer tokens than splits
        req_to_token, req_rows = make_req_to_token(kv_lens, 512, gen)
        q = torch.randn(len(kv_lens), num_kv_heads * group, HEAD_DIM, generator=gen)
        kv = torch.tensor(kv_lens)
        out = torch.full_like(q, float("nan"))
        args = (q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25)
        decode_attention(*args, num_splits, out=out, block_n=16, split_counter=counter)
        ref = decode_attention_ref(*args)
        assert relative_error(out, ref) < 1e-5
        assert not counter.any()


def test_merged_decode_attention_over_more_splits_than_one_merge_chunk_and_a_group_of_seven():
    gen = torch.Generator().manual_seed(11)
    kv_lens = [384, 3]  # 24 splits of 16 keys: the merge walks its partials in two chunks (16 + 8)
    k_cache, v_cache = make_cache(1200, 2, torch.float16, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 1200, gen)
    q = torch.randn(2, 14, HEAD_DIM, generator=gen).half()  # 7 query heads per KV head (Qwen2-7B's ratio)
    kv, counter = torch.tensor(kv_lens), torch.zeros(2, 2, dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25, 24, block_n=16, split_counter=counter)
    ref = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25)
    assert merge_chunk(8, HEAD_DIM) < 24
    assert relative_error(out, ref) < 5e-3
    assert not counter.any()


def rope_rows(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(num_tokens, HEAD_DIM // 2, generator=gen) * 6.3
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("num_splits", "merged"), [(1, False), (3, False), (3, True), (8, True)])
def test_decode_attention_with_fused_rotary_and_kv_store(group: int, num_splits: int, merged: bool):
    """Unrotated q/k in: the kernel rotates q, and k of the newest position goes into the cache first."""
    gen = torch.Generator().manual_seed(300 + group * 10 + num_splits)
    num_kv_heads = 2
    kv_lens = [1, 17, 40, 5]
    k_cache, v_cache = make_cache(256, num_kv_heads, torch.float32, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    kv = torch.tensor(kv_lens)
    slots = req_to_token[req_rows, kv - 1].long()
    k_cache[slots], v_cache[slots] = float("nan"), float("nan")  # unwritten slots would poison the output
    qkv = torch.randn(len(kv_lens), (group + 2) * num_kv_heads, HEAD_DIM, generator=gen)  # q | k | v heads
    q, k, v = qkv.split([group * num_kv_heads, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = rope_rows(len(kv_lens), gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[slots], expected_v[slots] = rotary_embedding_ref(k, cos, sin), v
    rotated_q = rotary_embedding_ref(q, cos, sin)
    ref = decode_attention_ref(rotated_q, expected_k, expected_v, req_to_token, req_rows, kv, 0.25)
    counter = torch.zeros(len(kv_lens), num_kv_heads, dtype=torch.int32) if merged else None
    new_token = NewTokenKV(k=k, v=v, cos=cos, sin=sin, slots=slots)
    args = (q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25)
    out = decode_attention(*args, num_splits, block_n=16, split_counter=counter, new_token=new_token)
    assert relative_error(out, ref) < 1e-5
    assert relative_error(k_cache, expected_k) < 1e-6 and torch.equal(v_cache, expected_v)
