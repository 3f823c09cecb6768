"""The few-row GEMV with fused prologues against its reference (unfused roundings, fp32 product with the
dequantized weight): plain weights at one row, FP8 / int8 / int4 weights at one to several rows."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.types import GemvConfig, QuantizedWeight
from tgi_compat.kernels.quant.int4_layout import int4_period, pack_int4

# Small tiles so the interpreter walks several programs and K blocks, ragged and even; with and without the
# next tile's prefetch.
CONFIGS = [
    GemvConfig(block_n=8, block_k=32, num_warps=1),
    GemvConfig(block_n=16, block_k=64, num_warps=2, prefetch=True),
]


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


# --- quantized weights ------------------------------------------------------------------------------


def _quantized(fmt: str, n: int, k: int, gen: torch.Generator, dtype: torch.dtype, group: int = 32) -> QuantizedWeight:
    if fmt == "int8":
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 too: the +128 bias trick
        return QuantizedWeight(q, torch.rand(n, generator=gen) / 100)
    if fmt == "fp8":
        return QuantizedWeight(
            torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn), torch.rand(n, generator=gen) / 10
        )
    if fmt == "fp8 per tensor":
        return QuantizedWeight(torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn), torch.tensor(0.05))
    packed = pack_int4(torch.randint(0, 16, (n, k), generator=gen), int4_period(group))
    scale = (torch.rand(n, k // group, generator=gen) / 50).to(dtype)
    return QuantizedWeight(packed, scale, torch.randint(0, 16, scale.shape, generator=gen).to(dtype), group)


FORMATS = ["int8", "fp8", "fp8 per tensor", "int4"]
QUANT_CONFIG = GemvConfig(block_n=8, block_k=64, num_warps=1)  # int4 groups of 32: two periods a K tile, two tiles


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
def test_quantized_gemv_matches_dequantized_reference(fmt: str, num_rows: int, prologue: str):
    _check_quantized(fmt, num_rows, prologue, 128 if fmt == "int4" else 96)  # int8/fp8: a ragged last K block


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8 per tensor"])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
def test_one_row_of_byte_weights_in_whole_tiles(fmt: str, prologue: str):
    """1-byte weights at one row with K tiles that divide K (the unmasked K loop)."""
    _check_quantized(fmt, 1, prologue, 128)


def _check_quantized(fmt: str, num_rows: int, prologue: str, k: int) -> None:
    gen = torch.Generator().manual_seed(num_rows + len(fmt) + k)
    n, dtype = 37, torch.float16
    weight = _quantized(fmt, n, k, gen, dtype)
    x = torch.randn(num_rows, 2 * k if prologue == "silu_mul" else k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    kwargs: dict = {"silu_mul": True} if prologue == "silu_mul" else {}
    summed = None
    if prologue == "rmsnorm":
        norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
        kwargs = dict(norm_weight=norm_weight, eps=1e-5, residual=torch.randn(num_rows, k, generator=gen).to(dtype))
        summed = torch.full((num_rows, k), float("nan"), dtype=dtype)
    out = gemv(x, weight, bias, residual_out=summed, config=QUANT_CONFIG, **kwargs)
    ref, ref_summed = gemv_ref(x, weight, bias, **kwargs)
    assert out.shape == (num_rows, n) and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    if summed is not None:
        torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)


@pytest.mark.parametrize(
    "k, group, block_k",
    # a tile narrower than the period (widened to it); a tile that does not divide K (shrunk); two groups
    # of 128 in a tile of two periods; a group of 256 over two periods
    [(128, 64, 32), (192, 64, 128), (512, 128, 256), (512, 256, 512)],
)
@pytest.mark.parametrize("prefetch", [False, True])
def test_int4_gemv_group_and_block_sizes(k: int, group: int, block_k: int, prefetch: bool):
    gen = torch.Generator().manual_seed(k + block_k)
    weight = _quantized("int4", 24, k, gen, torch.bfloat16, group)
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    out = gemv(x, weight, config=GemvConfig(block_n=8, block_k=block_k, num_warps=1, prefetch=prefetch))
    torch.testing.assert_close(out, gemv_ref(x, weight)[0], rtol=1e-2, atol=1e-2)


def test_int4_dequantize_reads_the_packed_layout():
    q = torch.arange(16).view(1, 16)
    weight = QuantizedWeight(pack_int4(q, 8), torch.tensor([[2.0, 1.0]]), torch.tensor([[1.0, 0.0]]), group_size=8)
    assert weight.shape == (1, 16)
    assert weight.dequantize().tolist() == [[2.0 * (v - 1) for v in range(8)] + [float(v) for v in range(8, 16)]]


@pytest.mark.parametrize("fmt, num_rows", [("int4", 1), ("int4", 3), ("fp8", 1)])
def test_default_configs_at_a_llama_width(fmt: str, num_rows: int):
    """K = 4096 with the configs the model runs (int4: one 4,096-wide tile of 32 periods; FP8: 16-byte runs)."""
    gen = torch.Generator().manual_seed(num_rows)
    weight = _quantized(fmt, 24, 4096, gen, torch.float16, group=128)
    x, residual = (torch.randn(num_rows, 4096, generator=gen).to(torch.float16) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(4096, generator=gen)).to(torch.float16)
    kwargs = dict(norm_weight=norm_weight, eps=1e-5, residual=residual)
    out = gemv(x, weight, residual_out=torch.empty_like(residual), **kwargs)
    torch.testing.assert_close(out, gemv_ref(x, weight, **kwargs)[0], rtol=1e-2, atol=1e-2)


def _prologue_inputs(prologue: str, num_rows: int, k: int, gen: torch.Generator):
    """fp16 x and the gemv keywords of `prologue` ("none", "rmsnorm" with a residual, "silu_mul"), and the
    residual-sum output an rmsnorm prologue writes (NaN until written)."""
    x = torch.randn(num_rows, 2 * k if prologue == "silu_mul" else k, generator=gen).to(torch.float16)
    kwargs: dict = {"silu_mul": True} if prologue == "silu_mul" else {}
    summed = None
    if prologue == "rmsnorm":
        norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.float16)
        residual = torch.randn(num_rows, k, generator=gen).to(torch.float16)
        kwargs = dict(norm_weight=norm_weight, eps=1e-5, residual=residual)
        summed = torch.full((num_rows, k), float("nan"), dtype=torch.float16)
    return x, kwargs, summed


@pytest.mark.parametrize("split_k, block_k", [(2, 64), (4, 32), (8, 128)])  # 8: shrunk to the 4 periods of K
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
def test_int4_split_k_adds_the_partials_and_resets_its_counters(split_k: int, block_k: int, num_rows: int, prologue):
    """Split-K (several programs along K, the last one adding the partial sums): twice in a row, so the
    second launch finds the counters the first one reset."""
    from tgi_compat.kernels.split_k import split_k_counters

    k = 128
    config = GemvConfig(block_n=8, block_k=block_k, num_warps=1, split_k=split_k, prefetch=split_k == 4)
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed + split_k)
        weight = _quantized("int4", 21, k, gen, torch.float16, group=32)
        x, kwargs, summed = _prologue_inputs(prologue, num_rows, k, gen)
        bias = torch.randn(21, generator=gen).to(torch.float16)
        out = gemv(x, weight, bias, residual_out=summed, config=config, **kwargs)
        ref, ref_summed = gemv_ref(x, weight, bias, **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
        if summed is not None:
            torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
        assert not split_k_counters(x.device, 3).any()


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("prologue", ["rmsnorm", "silu_mul"])
def test_separate_prologue_runs_the_elementwise_kernel_first(fmt: str, prologue: str):
    """GemvConfig.separate_prologue: RMSNorm (with the residual sum) or SiLU-mul as its own kernel, then the
    GEMV without a prologue: the unfused roundings, so the reference's."""
    k, n, rows = 128, 21, 2
    gen = torch.Generator().manual_seed(len(fmt) + len(prologue))
    weight = _quantized(fmt, n, k, gen, torch.float16)
    x, kwargs, summed = _prologue_inputs(prologue, rows, k, gen)
    config = GemvConfig(block_n=8, block_k=64, num_warps=1, separate_prologue=True)
    out = gemv(x, weight, residual_out=summed, config=config, **kwargs)
    ref, ref_summed = gemv_ref(x, weight, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    if summed is not None:
        torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
