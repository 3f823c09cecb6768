"""Sliding-window attention, chunked local attention and attention-logit soft-capping in the decode and extend
kernels, against their PyTorch references (windows and chunks shorter than, equal to and longer than the context);
and
Gemma's GeGLU through the gated-activation kernel."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernel_attention import make_cache, make_req_to_token, relative_error
from tgi_compat.kernels.attention.decode import decode_attention, decode_attention_ref
from tgi_compat.kernels.attention.prefill import prefill_attention, prefill_attention_ref, token_spans

# (sliding window, soft-cap, attention chunk): windows and chunks shorter than the context, which crosses chunk edges
SWITCHES = [(7, None, None), (None, 5.0, None), (20, 2.0, None), (None, None, 8), (None, None, 16)]


@pytest.mark.parametrize("merged", [False, True], ids=["two-stage", "merged"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("window", "softcap", "chunk"), SWITCHES)
def test_decode_attention_window_softcap_and_chunk(window, softcap, chunk, num_splits, merged):
    gen = torch.Generator().manual_seed(num_splits)
    num_kv_heads, group = 2, 4
    kv_lens = [1, 17, 40, 5]  # inside, at and far past the window; across chunk edges
    k_cache, v_cache = make_cache(256, num_kv_heads, torch.float32, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    q = torch.randn(len(kv_lens), num_kv_heads * group, 16, generator=gen) * 3  # large scores: the cap bites
    kv = torch.tensor(kv_lens)
    counter = torch.zeros(len(kv_lens), num_kv_heads, dtype=torch.int32) if merged else None
    options = dict(sliding_window=window, softcap=softcap, attention_chunk=chunk)
    out = decode_attention(
        q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25, num_splits, block_n=16, split_counter=counter, **options
    )
    ref = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25, **options)
    assert relative_error(out, ref) < 1e-5
    if merged:
        assert counter.eq(0).all()
    plain = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv, 0.25)
    assert relative_error(plain, ref) > 1e-3  # the switches change the result


@pytest.mark.parametrize(("window", "softcap", "chunk"), SWITCHES)
def test_prefill_attention_window_softcap_and_chunk(window, softcap, chunk):
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, group = 2, 2
    q_lens = [5, 1, 23, 40]
    kv_lens = [5, 30, 41, 40]  # a short prompt, a decode, a chunk over a cached prefix, a long prompt
    k_cache, v_cache = make_cache(256, num_kv_heads, torch.float32, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    q_len_t = torch.tensor(q_lens)
    q_start = torch.cumsum(q_len_t, 0) - q_len_t
    q = torch.randn(sum(q_lens), num_kv_heads * group, 16, generator=gen) * 3
    args = (q, k_cache, v_cache, req_to_token, req_rows, q_start, q_len_t, torch.tensor(kv_lens))
    options = dict(sliding_window=window, softcap=softcap, attention_chunk=chunk)
    out = prefill_attention(*args, max_q_len=max(q_lens), scale=0.3, block_m=16, block_n=16, **options)
    ref = prefill_attention_ref(*args, scale=0.3, **options)
    assert relative_error(out, ref) < 1e-5
    assert relative_error(prefill_attention_ref(*args, scale=0.3), ref) > 1e-3


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_attention_opens_bidirectional_spans(window):
    """Image placeholders that see each other both ways (Gemma 3): spans that cross the kernel's query and key
    blocks, start in the cached prefix, outlast the window, and two in one request; a decode row and a request
    without any beside them."""
    gen = torch.Generator().manual_seed(5)
    num_kv_heads, group = 2, 2
    q_lens = [1, 37, 23, 12]
    kv_lens = [30, 37, 41, 12]
    spans = [[], [(3, 14), (20, 35)], [(10, 30), (33, 41)], []]  # request 2's chunk starts at 18, inside a span
    k_cache, v_cache = make_cache(256, num_kv_heads, torch.float32, gen)
    req_to_token, req_rows = make_req_to_token(kv_lens, 256, gen)
    q_len_t = torch.tensor(q_lens)
    q_start = torch.cumsum(q_len_t, 0) - q_len_t
    q = torch.randn(sum(q_lens), num_kv_heads * group, 16, generator=gen)
    args = (q, k_cache, v_cache, req_to_token, req_rows, q_start, q_len_t, torch.tensor(kv_lens))
    opened = token_spans(spans, q_lens, kv_lens)
    assert opened[1 + 37 : 1 + 37 + 12].tolist() == [[10, 30]] * 12 and opened[:1].tolist() == [[0, 0]]
    out = prefill_attention(
        *args, max_q_len=max(q_lens), scale=0.3, block_m=16, block_n=16, sliding_window=window, spans=opened
    )
    ref = prefill_attention_ref(*args, scale=0.3, sliding_window=window, spans=opened)
    assert relative_error(out, ref) < 1e-5
    causal = prefill_attention_ref(*args, scale=0.3, sliding_window=window)
    assert relative_error(causal, ref) > 1e-3
    rows_without = list(range(1)) + list(range(sum(q_lens) - 12, sum(q_lens)))
    assert torch.equal(ref[rows_without], causal[rows_without])  # rows in no span keep the causal answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_mul_matches_reference(dtype):
    """Gemma's GeGLU through the gated-activation kernel's GELU_TANH switch."""
    from tgi_compat.kernels.elementwise.silu_mul import gelu_tanh_mul_ref, silu_mul

    x = (torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(silu_mul(x, gelu_tanh=True), gelu_tanh_mul_ref(x), **tolerance)
