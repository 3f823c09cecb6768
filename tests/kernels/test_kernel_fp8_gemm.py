"""The skinny FP8 GEMM (tgi_compat/kernels/quant/fp8_gemm.py) against its float32 torch reference, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.quant.fp8_gemm import Fp8GemmConfig, fp8_gemm, fp8_gemm_ref
from tgi_compat.kernels.quant.per_token import quant_per_token_ref
from tgi_compat.kernels.split_k import split_k_counters
from tgi_compat.modeling.layers.quantization.fp8 import quantize_weight_per_channel


@pytest.mark.parametrize(
    ("num_rows", "n", "k", "has_bias", "out_dtype"),
    [
        (64, 96, 256, False, torch.bfloat16),  # the decode width it is for, two K tiles
        (37, 48, 200, True, torch.float16),  # ragged rows and columns, K not a multiple of any tile
        (5, 40, 128, True, torch.bfloat16),  # few rows: a 16-row tile, mostly masked
    ],
)
def test_fp8_gemm_matches_reference(num_rows: int, n: int, k: int, has_bias: bool, out_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_rows)
    x_q, x_scale = quant_per_token_ref(torch.randn(num_rows, k, generator=gen) * 4, torch.float8_e4m3fn)
    weight, weight_scale = quantize_weight_per_channel(torch.randn(n, k, generator=gen) / 16)
    bias = torch.randn(n, generator=gen).to(out_dtype) if has_bias else None
    out = fp8_gemm(x_q, x_scale, weight, weight_scale, bias, out_dtype)
    ref = fp8_gemm_ref(x_q, x_scale, weight, weight_scale, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (num_rows, n)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_fp8_gemm_every_config_of_the_sweep_agrees():
    """Tile shapes the GPU sweep tries (benchmarks/device/fp8_gemm.py) compute the same product."""
    gen = torch.Generator().manual_seed(1)
    x_q, x_scale = quant_per_token_ref(torch.randn(64, 256, generator=gen), torch.float8_e4m3fn)
    weight, weight_scale = quantize_weight_per_channel(torch.randn(128, 256, generator=gen))
    ref = fp8_gemm_ref(x_q, x_scale, weight, weight_scale)
    for config in (
        Fp8GemmConfig(64, 32, 128, 4, 3),
        Fp8GemmConfig(64, 128, 256, 4, 4),
        Fp8GemmConfig(32, 64, 64, 4, 2),
        Fp8GemmConfig(32, 32, 64, 4, 3, split_k=4),  # four programs share each tile's K walk
        Fp8GemmConfig(64, 64, 128, 4, 4, split_k=2),
        Fp8GemmConfig(64, 32, 128, 4, 3, tma=True),  # tiles through TMA descriptors
        Fp8GemmConfig(64, 64, 64, 4, 4, split_k=2, tma=True),
    ):
        out = fp8_gemm(x_q, x_scale, weight, weight_scale, config=config)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("split_k", [1, 2])
def test_fp8_gemm_tma_reads_ragged_tiles_as_zeros(split_k: int):
    """Through descriptors no load is masked: the rows past M, the columns past N and (without a split) the K
    past the last whole tile come in as zeros from the descriptor's bounds."""
    gen = torch.Generator().manual_seed(3)
    k = 208 if split_k == 1 else 256  # 208: 16-byte rows, not a multiple of the 64-wide K tile
    x_q, x_scale = quant_per_token_ref(torch.randn(37, k, generator=gen) * 4, torch.float8_e4m3fn)
    weight, weight_scale = quantize_weight_per_channel(torch.randn(48, k, generator=gen) / 16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    config = Fp8GemmConfig(64, 32, 64, 4, 3, split_k=split_k, tma=True)
    out = fp8_gemm(x_q, x_scale, weight, weight_scale, bias, config=config)
    ref = fp8_gemm_ref(x_q, x_scale, weight, weight_scale, bias)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_fp8_gemm_split_k_is_deterministic_and_leaves_its_counters_at_zero():
    """The last program of a tile adds the partials in split order and resets the tile's counter, so launch
    after launch gives the same bits (and the next kernel on the shared counters starts from zero)."""
    gen = torch.Generator().manual_seed(2)
    x_q, x_scale = quant_per_token_ref(torch.randn(21, 512, generator=gen), torch.float8_e4m3fn)
    weight, weight_scale = quantize_weight_per_channel(torch.randn(80, 512, generator=gen))
    bias = torch.randn(80, generator=gen).to(torch.bfloat16)
    config = Fp8GemmConfig(32, 32, 64, 4, 3, split_k=4)
    first = fp8_gemm(x_q, x_scale, weight, weight_scale, bias, config=config)
    for _ in range(3):
        assert torch.equal(fp8_gemm(x_q, x_scale, weight, weight_scale, bias, config=config), first)
    assert not split_k_counters(x_q.device, 3).any()
    ref = fp8_gemm_ref(x_q, x_scale, weight, weight_scale, bias)
    torch.testing.assert_close(first.float(), ref.float(), rtol=1e-2, atol=1e-2)
