"""The GEMV's NORM_ADD_NORM prologue (Gemma 2/3's post-sublayer norm, residual add and next pre-norm fused
into the next projection at a decode row) against the three unfused ops, and the op that picks it."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.types import GemvConfig, QuantizedWeight

CONFIGS = [
    GemvConfig(block_n=8, block_k=32, num_warps=1),
    GemvConfig(block_n=16, block_k=64, num_warps=2, prefetch=True),
    GemvConfig(
        block_n=8, block_k=32, num_warps=1, separate_prologue=True
    ),  # tgi_compat/kernels/elementwise/rmsnorm.py's, then the GEMV
]


def _inputs(rows: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(rows, k, generator=gen)).to(dtype)  # an un-normed sublayer output
    residual = torch.randn(rows, k, generator=gen).to(dtype)
    x_norm_weight = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype)
    return x, residual, x_norm_weight, norm_weight, gen


def _run(x, weight, residual, x_norm_weight, norm_weight, config, bias=None):
    summed = torch.full_like(residual, float("nan"))
    norms = dict(norm_weight=norm_weight, eps=1e-5, residual=residual, x_norm_weight=x_norm_weight, x_eps=1e-6)
    out = gemv(x, weight, bias, residual_out=summed, config=config, **norms)
    ref, ref_summed = gemv_ref(x, weight, bias, **norms)
    return out, summed, ref, ref_summed


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("k", [96, 300])  # 300: ragged against every K tile and the 256-wide passes
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_add_norm_prologue_matches_the_unfused_ops(config: GemvConfig, k: int, dtype: torch.dtype):
    x, residual, x_norm_weight, norm_weight, gen = _inputs(1, k, dtype, seed=k)
    weight = (torch.randn(45, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype)
    before = residual.clone()
    out, summed, ref, ref_summed = _run(x, weight, residual, x_norm_weight, norm_weight, config, bias)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    # the sum is the unfused ops' bits in fp16 (same roundings); fp32 within an ulp of the fp32 rsqrt
    torch.testing.assert_close(summed, ref_summed, rtol=0 if dtype == torch.float16 else 1e-6, atol=1e-6)
    torch.testing.assert_close(residual, before, rtol=0, atol=0)
    # without x's norm the result differs: the prologue really normalises x before the add
    plain, _ = gemv_ref(x, weight, bias, norm_weight=norm_weight, eps=1e-5, residual=residual)
    assert not torch.allclose(plain, out, **tol)


@pytest.mark.parametrize("num_rows, k", [(1, 128), (3, 128), (8, 1100)])  # 8 rows: x's 1/rms pass takes 2 steps
def test_norm_add_norm_prologue_over_a_row_scaled_weight_at_several_rows(num_rows: int, k: int):
    n = 24
    x, residual, x_norm_weight, norm_weight, gen = _inputs(num_rows, k, torch.float16, seed=num_rows)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    weight = QuantizedWeight(q, torch.rand(n, generator=gen) / 100)
    out, summed, ref, ref_summed = _run(x, weight, residual, x_norm_weight, norm_weight, CONFIGS[0])
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)


def test_norm_add_norm_needs_a_residual_and_a_norm():
    x, residual, x_norm_weight, norm_weight, _ = _inputs(1, 32, torch.float32, seed=0)
    weight = torch.randn(8, 32)
    with pytest.raises(AssertionError):
        gemv(x, weight, x_norm_weight=x_norm_weight, norm_weight=norm_weight, eps=1e-5)  # no residual
    with pytest.raises(AssertionError):
        gemv(x, weight, x_norm_weight=x_norm_weight, residual=residual, residual_out=torch.empty_like(residual))
