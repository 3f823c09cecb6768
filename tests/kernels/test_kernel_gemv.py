"""The batch-1 GEMV with fused prologues against its reference (unfused roundings, fp32 product)."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import GemvConfig, gemv, gemv_ref

# Small tiles so the interpreter walks several programs and K blocks, ragged and even.
CONFIGS = [GemvConfig(block_n=8, block_k=32, num_warps=1), GemvConfig(block_n=16, block_k=64, num_warps=2)]


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int, x_cols: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, x_cols or k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, weight, bias, gen


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n, k", [(37, 96), (64, 128), (5, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plain_gemv_with_and_without_bias(config: GemvConfig, n: int, k: int, dtype: torch.dtype):
    x, weight, bias, _ = _inputs(n, k, dtype, seed=n + k)
    for b in (None, bias):
        out = gemv(x, weight, b, config=config)
        ref, _ = gemv_ref(x, weight, b)
        assert out.shape == (1, n) and out.dtype == dtype
        torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_prologue_normalises_the_residual_sum(config: GemvConfig, with_residual: bool, dtype: torch.dtype):
    n, k = 45, 96
    x, weight, _, gen = _inputs(n, k, dtype, seed=7)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    residual = torch.randn(1, k, generator=gen).to(dtype) if with_residual else None
    before = residual.clone() if with_residual else None
    summed = torch.full((1, k), float("nan"), dtype=dtype) if with_residual else None
    out = gemv(x, weight, norm_weight=norm_weight, eps=1e-5, residual=residual, residual_out=summed, config=config)
    ref, ref_summed = gemv_ref(x, weight, norm_weight=norm_weight, eps=1e-5, residual=residual)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    if with_residual:
        torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)  # written once, exactly
        torch.testing.assert_close(residual, before, rtol=0, atol=0)  # the input is left alone


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_prologue_reads_gate_then_up(config: GemvConfig, dtype: torch.dtype):
    n, k = 33, 72
    x, weight, bias, _ = _inputs(n, k, dtype, seed=11, x_cols=2 * k)
    out = gemv(x, weight, bias, silu_mul=True, config=config)
    ref, _ = gemv_ref(x, weight, bias, silu_mul=True)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    swapped = torch.cat((x[:, k:], x[:, :k]), dim=1)  # the halves are not interchangeable
    assert not torch.allclose(gemv(swapped, weight, bias, silu_mul=True, config=config), out, **_tol(dtype))


def test_gemv_refuses_an_aliased_residual_output():
    x, weight, _, _ = _inputs(8, 32, torch.float32, seed=3)
    residual = torch.randn(1, 32)
    with pytest.raises(AssertionError):
        gemv(x, weight, norm_weight=torch.ones(32), eps=1e-6, residual=residual, residual_out=residual)
