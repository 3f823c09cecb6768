"""kv_store, rmsnorm, rotary and silu_mul kernels against their PyTorch references."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.attention.kv_store import kv_store, kv_store_ref
from tgi_compat.kernels.attention.rotary import rotary_and_kv_store, rotary_embedding, rotary_embedding_ref
from tgi_compat.kernels.elementwise.rmsnorm import (
    norm_add_rmsnorm,
    norm_add_rmsnorm_ref,
    qk_rmsnorm,
    qk_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from tgi_compat.kernels.elementwise.silu_mul import silu_mul, silu_mul_ref


def test_kv_store_writes_only_the_given_slots_from_strided_views():
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 5, 3, 24  # neither dim a power of two
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, generator=gen)
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([7, 0, 19, 3, 12])
    k_cache = torch.full((20, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full((20, num_kv_heads, head_dim), float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store(k, v, k_cache, v_cache, slots)
    kv_store_ref(k, v, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_matches_reference(with_residual: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 72, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(72, generator=gen)).to(dtype)
    residual = torch.randn(6, 72, generator=gen).to(dtype) if with_residual else None
    residual_ref = residual.clone() if with_residual else None
    out = rmsnorm(x, weight, 1e-5, residual=residual)
    ref = rmsnorm_ref(x, weight, 1e-5, residual=residual_ref)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if with_residual:
        torch.testing.assert_close(residual, residual_ref, rtol=0, atol=0)  # x + residual, in place


def test_rmsnorm_writes_the_sum_to_a_separate_buffer_when_asked():
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    weight = torch.rand(40, generator=gen)
    before = residual.clone()
    summed = torch.empty_like(residual)
    out = rmsnorm(x, weight, 1e-6, residual=residual, residual_out=summed)
    torch.testing.assert_close(residual, before, rtol=0, atol=0)
    torch.testing.assert_close(summed, x + before)
    torch.testing.assert_close(out, rmsnorm_ref(x + before, weight, 1e-6))


@pytest.mark.parametrize("num_cols", [37, 100])  # not a power of two: masked lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_norm_add_rmsnorm_rounds_as_the_three_unfused_ops(num_cols: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(5, num_cols, generator=gen)).to(dtype)
    residual = torch.randn(5, num_cols, generator=gen).to(dtype)
    x_weight = (1 + 0.2 * torch.randn(num_cols, generator=gen)).to(dtype)
    weight = (1 + 0.2 * torch.randn(num_cols, generator=gen)).to(dtype)
    before, residual_ref = residual.clone(), residual.clone()
    summed = torch.empty_like(residual)
    out = norm_add_rmsnorm(x, x_weight, 1e-6, residual, weight, 1e-5, residual_out=summed)
    ref = norm_add_rmsnorm_ref(x, x_weight, 1e-6, residual_ref, weight, 1e-5)
    torch.testing.assert_close(residual, before, rtol=0, atol=0)  # a separate residual_out leaves it alone
    # fp16: the sum is bit-equal (each op rounds to the dtype where the unfused one does). Triton's interpreter
    # rounds fp32 -> bf16 toward zero (the GPU to nearest), so bf16 gets a few ulps here.
    exact = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.07}[dtype]
    torch.testing.assert_close(summed, residual_ref, rtol=exact, atol=exact)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 0.07}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert (out != 0).any()
    in_place = norm_add_rmsnorm(x, x_weight, 1e-6, residual, weight, 1e-5)  # default: the sum replaces residual
    torch.testing.assert_close(in_place, out, rtol=0, atol=0)
    torch.testing.assert_close(residual, summed, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_qk_rmsnorm_norms_q_and_k_heads_in_place_in_the_qkv_buffer(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(6)
    tokens, q_heads, kv_heads, head_dim = 3, 5, 2, 24  # neither a power of two
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    v_before = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    q_weight = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_weight = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype)
    ref = qk_rmsnorm_ref(qk, q_weight, k_weight, 1e-6, q_heads)
    swapped = qk_rmsnorm_ref(qk, k_weight, q_weight, 1e-6, q_heads)  # the weights are not interchangeable
    assert qk_rmsnorm(qk, q_weight, k_weight, 1e-6, q_heads) is qk
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 0.05}[dtype]  # interpreter: bf16 truncates
    torch.testing.assert_close(qk, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(qkv[:, (q_heads + kv_heads) * head_dim :], v_before, rtol=0, atol=0)  # v untouched
    assert not torch.allclose(swapped, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("gather_positions", [False, True])
def test_rotary_rotates_q_and_k_in_place(gather_positions: bool):
    gen = torch.Generator().manual_seed(3)
    num_tokens, head_dim = 4, 20
    angles = torch.rand(50, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 49, 3, 3])
    qkv = torch.randn(num_tokens, (6 + 2 + 2) * head_dim, generator=gen)
    q = qkv[:, : 6 * head_dim].view(num_tokens, 6, head_dim)
    k = qkv[:, 6 * head_dim : 8 * head_dim].view(num_tokens, 2, head_dim)
    v_before = qkv[:, 8 * head_dim :].clone()
    q_ref = rotary_embedding_ref(q, cos, sin, positions)
    k_ref = rotary_embedding_ref(k, cos, sin, positions)
    if gather_positions:
        rotary_embedding(q, k, cos, sin, positions)
    else:
        rotary_embedding(q, k, cos[positions].contiguous(), sin[positions].contiguous())
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(qkv[:, 8 * head_dim :], v_before, rtol=0, atol=0)  # v untouched


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_rotary_and_kv_store_rotates_q_k_and_writes_k_v_to_their_slots(num_q_heads: int, num_kv_heads: int):
    gen = torch.Generator().manual_seed(5)
    num_tokens, head_dim, num_slots = 3, 24, 12  # head_dim/2 = 12: not a power of two
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qk_size = (num_q_heads + num_kv_heads) * head_dim
    qk = qkv[:, :qk_size].view(num_tokens, num_q_heads + num_kv_heads, head_dim)
    v = qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([9, 0, 4])
    qk_ref = rotary_embedding_ref(qk, cos, sin)
    k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store_ref(qk_ref[:, num_q_heads:], v, k_ref, v_ref, slots)
    rotary_and_kv_store(qk, v, cos, sin, k_cache, v_cache, slots, num_q_heads)
    torch.testing.assert_close(qk, qk_ref)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True)  # other slots untouched (still NaN)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True)


def test_rotary_without_k_and_position_zero_is_identity():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 8, generator=gen)
    before = q.clone()
    cos, sin = torch.ones(1, 4), torch.zeros(1, 4)
    rotary_embedding(q, None, cos, sin, torch.zeros(2, dtype=torch.int64))
    torch.testing.assert_close(q, before)


@pytest.mark.parametrize("intermediate", [40, 1500])  # one partial block; several blocks
def test_silu_mul_matches_reference(intermediate: int):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2 * intermediate, generator=gen)
    torch.testing.assert_close(silu_mul(x), silu_mul_ref(x))
    xh = x.half()
    torch.testing.assert_close(silu_mul(xh), silu_mul_ref(xh), rtol=1e-3, atol=1e-3)
