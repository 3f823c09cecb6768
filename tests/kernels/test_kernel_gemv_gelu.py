"""The GEMV's GeGLU prologue (Gemma's down projection at a decode row): gelu_tanh(gate) * up then W,
against the unfused reference, and different from the SwiGLU prologue on the same input."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.types import GemvConfig


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_mul_prologue_matches_the_unfused_pair(dtype: torch.dtype):
    n, k = 33, 72  # off the block multiples: the K mask and the row clamp both work
    gen = torch.Generator().manual_seed(5)
    x = (2 * torch.randn(1, 2 * k, generator=gen)).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    config = GemvConfig(block_n=8, block_k=32, num_warps=1)
    out = gemv(x, weight, bias, silu_mul=True, gelu_tanh=True, config=config)
    ref, _ = gemv_ref(x, weight, bias, silu_mul=True, gelu_tanh=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    silu = gemv(x, weight, bias, silu_mul=True, config=config)
    assert not torch.allclose(silu, out, **tol)


def test_gelu_tanh_mul_prologue_over_int4_weights():
    """The int4 kernel's prologue takes the GeGLU too (a Gemma AWQ/GPTQ checkpoint's down projection)."""
    from tgi_compat.kernels.gemv.types import QuantizedWeight
    from tgi_compat.kernels.quant.int4_layout import int4_period, pack_int4

    n, k, group = 24, 128, 32
    gen = torch.Generator().manual_seed(6)
    scale = (torch.rand(n, k // group, generator=gen) / 50).to(torch.float16)
    zero = torch.randint(0, 16, scale.shape, generator=gen).to(torch.float16)
    weight = QuantizedWeight(
        pack_int4(torch.randint(0, 16, (n, k), generator=gen), int4_period(group)), scale, zero, group
    )
    x = (2 * torch.randn(2, 2 * k, generator=gen)).to(torch.float16)
    config = GemvConfig(block_n=8, block_k=64, num_warps=1)
    out = gemv(x, weight, silu_mul=True, gelu_tanh=True, config=config)
    torch.testing.assert_close(out, gemv_ref(x, weight, silu_mul=True, gelu_tanh=True)[0], rtol=1e-2, atol=1e-2)
