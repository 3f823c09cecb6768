"""The attention kernels read an FP8 KV cache (unit scale) as the same keys and values widened to the
model's dtype: against the references run on the widened cache."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernel_attention import HEAD_DIM, make_cache, make_req_to_token, relative_error
from tgi_compat.kernels.attention.decode import decode_attention, decode_attention_ref
from tgi_compat.kernels.attention.prefill import prefill_attention, prefill_attention_ref


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_decode_attention_reads_fp8_cache(kv_dtype: torch.dtype, q_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    kv_lens = [1, 21, 40]
    k_cache, v_cache = (c.to(kv_dtype) for c in make_cache(256, 2, torch.float32, gen))
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    q = torch.randn(len(kv_lens), 8, HEAD_DIM, generator=gen).to(q_dtype)
    kv = torch.tensor(kv_lens)
    out = decode_attention(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25, 3, block_n=16)
    ref = decode_attention_ref(q, k_cache.to(q_dtype), v_cache.to(q_dtype), req_to_token, req_rows, kv, 0.25)
    assert out.dtype == q_dtype
    assert relative_error(out, ref) < (1e-5 if q_dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_prefill_attention_reads_fp8_cache(kv_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(4)
    q_lens, kv_lens = [5, 1, 23], [5, 30, 41]
    k_cache, v_cache = (c.to(kv_dtype) for c in make_cache(256, 2, torch.float32, gen))
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    q_len_t = torch.tensor(q_lens)
    q = torch.randn(sum(q_lens), 4, HEAD_DIM, generator=gen)
    rest = (req_to_token, req_rows, torch.cumsum(q_len_t, 0) - q_len_t, q_len_t, torch.tensor(kv_lens))
    out = prefill_attention(q, k_cache, v_cache, *rest, max_q_len=max(q_lens), scale=0.3, block_m=16, block_n=16)
    ref = prefill_attention_ref(q, k_cache.float(), v_cache.float(), *rest, scale=0.3)
    assert relative_error(out, ref) < 1e-5
