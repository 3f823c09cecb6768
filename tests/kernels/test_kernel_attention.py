"""Decode and extend attention kernels against their PyTorch references (ragged, GQA, splits)."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_attention_ref

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
