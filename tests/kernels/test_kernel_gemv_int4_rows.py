"""The int4 row-walking GEMV (kernels.gemv_int4_rows, `GemvConfig.rows_per_program`) against the reference with
the dequantized weight: N not a multiple of a program's rows, groups of 128 and 64, K slices of a power of two
of periods and padded ones, with and without split-K and prefetch, every prologue it takes."""

from __future__ import annotations

import pytest
import torch

from kernels.dequant_matmul import int4_period, pack_int4
from kernels.gemv import TUNED_INT4, GemvConfig, QuantizedWeight, gemv, gemv_ref, int4_config, split_k_counters


def _weight(n: int, k: int, group: int, gen: torch.Generator) -> QuantizedWeight:
    packed = pack_int4(torch.randint(0, 16, (n, k), generator=gen), int4_period(group))
    scale = (torch.rand(n, k // group, generator=gen) / 50).to(torch.float16)
    return QuantizedWeight(packed, scale, torch.randint(0, 16, scale.shape, generator=gen).to(torch.float16), group)


def _run(n: int, k: int, group: int, prologue: str, config: GemvConfig, seed: int = 0):
    """(out, reference, residual_out, its reference) of one launch at one row of x, with a bias."""
    gen = torch.Generator().manual_seed(seed + n + k + group)
    weight = _weight(n, k, group, gen)
    x = torch.randn(1, 2 * k if prologue in ("silu_mul", "gelu_tanh_mul") else k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    kwargs: dict = {}
    summed = None
    if prologue in ("silu_mul", "gelu_tanh_mul"):
        kwargs = dict(silu_mul=True, gelu_tanh=prologue == "gelu_tanh_mul")
    if prologue == "rmsnorm":
        norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.float16)
        kwargs = dict(norm_weight=norm_weight, eps=1e-5, residual=torch.randn(1, k, generator=gen).to(torch.float16))
        summed = torch.full((1, k), float("nan"), dtype=torch.float16)
    out = gemv(x, weight, bias, residual_out=summed, config=config, **kwargs)
    ref, ref_summed = gemv_ref(x, weight, bias, **kwargs)
    return out, ref, summed, ref_summed


CASES = [
    # (N, K, group, config): 37 rows over programs of 16 (a ragged last program, row groups of 4)
    (37, 256, 128, GemvConfig(block_n=4, rows_per_program=16)),
    # groups of 64 (periods of 64 features, 8 words), prefetching the next row group, 2 splits of 4 periods
    (40, 512, 64, GemvConfig(block_n=8, rows_per_program=16, prefetch=True, split_k=2)),
    # 2 splits of 3 periods each, padded to 4 and masked (as down's 14,336 over 4 splits: 28 periods)
    (21, 768, 128, GemvConfig(block_n=4, rows_per_program=8, split_k=2)),
    # 4 splits, one program along N covering all the rows
    (30, 1024, 64, GemvConfig(block_n=4, rows_per_program=32, prefetch=True, split_k=4)),
    # 7 splits of 2 periods: a split count that is no power of two (down's 112 periods over 7: 16 each, unpadded)
    (24, 1792, 128, GemvConfig(block_n=4, rows_per_program=8, prefetch=True, split_k=7)),
]


@pytest.mark.parametrize("n, k, group, config", CASES)
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul", "gelu_tanh_mul"])
def test_int4_rows_gemv_matches_dequantized_reference(n: int, k: int, group: int, config: GemvConfig, prologue):
    out, ref, summed, ref_summed = _run(n, k, group, prologue, config)
    assert out.shape == (1, n)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    if summed is not None:
        torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    assert not split_k_counters(out.device, 4).any()


@pytest.mark.parametrize("prologue", ["none", "rmsnorm"])
def test_int4_rows_split_k_is_deterministic(prologue: str):
    """Two launches on the same inputs give the same bits (the partials are added in split order), and the
    second one finds the counters the first one reset."""
    config = GemvConfig(block_n=4, rows_per_program=8, split_k=4)
    first = _run(21, 512, 128, prologue, config)[0]
    second = _run(21, 512, 128, prologue, config)[0]
    assert torch.equal(first, second)
    assert not split_k_counters(first.device, 3).any()


def test_int4_rows_kernel_only_where_measured():
    """The row-walking kernel runs where a GPU sweep chose it (Llama-3-8B's four one-row projections, TUNED_INT4);
    every other shape, and several rows, keep the tile kernel."""
    measured = {(n, k, prologue) for (n, k, prologue, rows), config in TUNED_INT4.items() if config.rows_per_program}
    assert {(n, k) for n, k, _ in measured} == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    for n, k, prologue in measured:
        assert int4_config(k, 1, 128, n, prologue).rows_per_program > 0
        assert int4_config(k, 8, 128, n, prologue).rows_per_program == 0
        assert int4_config(k, 1, 64, n, prologue).rows_per_program == 0  # tuned for groups of 128 only
    assert int4_config(2048, 1, 128, 2048, 0).rows_per_program == 0
