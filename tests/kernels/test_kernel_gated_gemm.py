"""The gated MLP GEMM (tgi_compat/kernels/gemm/gated.py) against its float32 torch reference, under the interpreter.

In fp16: the interpreter's bf16 `tl.dot` gives garbage (Triton 3.9, CPU); tests/gpu/test_kernels_gpu.py runs bf16
compiled."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.elementwise.silu_mul import gelu_tanh_mul_ref
from tgi_compat.kernels.gemm.gated import GatedGemmConfig, gated_gemm, gated_gemm_ref

SMALL = GatedGemmConfig(32, 32, 32, 4, 2, group_m=2)


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize(
    ("num_rows", "hidden", "padded", "inner", "has_bias"),
    [
        (64, 64, 64, 64, True),  # whole tiles, two K steps
        (45, 48, 96, 85, True),  # ragged rows, a partial K box, the padded width's tail dropped (Qwen's 3420 of 3456)
        (7, 96, 40, 40, False),  # a half that ends inside a column tile: the up half's rows must not leak in
    ],
)
def test_gated_gemm_matches_reference(num_rows, hidden, padded, inner, has_bias, tma):
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, hidden, generator=gen).half()
    weight = (torch.randn(2 * padded, hidden, generator=gen) / 8).half()
    bias = torch.randn(2 * padded, generator=gen).half() if has_bias else None
    out = gated_gemm(x, weight, bias, inner, config=SMALL._replace(tma=tma))
    ref = gated_gemm_ref(x, weight, bias, inner)
    assert out.shape == (num_rows, inner) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_gated_gemm_gelu_tanh_and_default_tiles():
    """GeGLU through the same switch as silu_mul, on the default (GPU) tile shape."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(130, 64, generator=gen)
    weight = torch.randn(2 * 128, 64, generator=gen) / 8
    out = gated_gemm(x, weight, gelu_tanh=True)
    both = x @ weight.t()
    torch.testing.assert_close(out, gelu_tanh_mul_ref(both), rtol=1e-4, atol=1e-4)
