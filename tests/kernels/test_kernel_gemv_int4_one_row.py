"""The one-row int4 GEMV (tgi_compat.kernels.gemv.int4_one_row, `GemvConfig.one_row`) against the reference with the
dequantized weight: N not a multiple of a program's rows, groups of 256, 128 and 64 (a group over two tiles, a
tile over two groups), several tiles a split (the software-pipelined loop), split-K by counts that are and are
not powers of two, every prologue it takes; split-K's determinism and where the tuned table selects it. Its
products are integer (f(x) in 16-bit fixed point a period, dp4a; spelled out in Triton under the interpreter):
an activation spread over nine orders of magnitude within a period stays within the output's rounding, and an
inf or NaN in x still makes the output NaN."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.gemv.config import int4_config
from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.int4_one_row import one_row_tiles
from tgi_compat.kernels.gemv.tuned import TUNED_INT4
from tgi_compat.kernels.gemv.types import GemvConfig, QuantizedWeight
from tgi_compat.kernels.quant.int4_layout import int4_period, pack_int4
from tgi_compat.kernels.split_k import split_k_counters


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
    # 37 rows over programs of 16 (a ragged last program); 2 tiles of one period, pipelined 2 deep
    (37, 256, 128, GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=2, one_row=True)),
    # groups of 64 (periods of 64 features, 8 words), tiles of 2 periods, 2 splits of 2 tiles
    (40, 512, 64, GemvConfig(block_n=8, block_k=128, num_warps=2, num_stages=3, split_k=2, one_row=True)),
    # groups of 256 over tiles of one period: each group's scale read by two tiles
    (24, 1024, 256, GemvConfig(block_n=8, block_k=128, num_warps=2, num_stages=3, one_row=True)),
    # 7 splits of 2 periods, each one tile (down's 112 periods over 7)
    (24, 1792, 128, GemvConfig(block_n=8, block_k=256, num_warps=2, num_stages=1, split_k=7, one_row=True)),
    # one tile over the whole K, as the tuned configs run it
    (21, 512, 128, GemvConfig(block_n=16, block_k=512, num_stages=1, one_row=True)),
]


@pytest.mark.parametrize("n, k, group, config", CASES)
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul", "gelu_tanh_mul"])
def test_int4_one_row_gemv_matches_dequantized_reference(n: int, k: int, group: int, config: GemvConfig, prologue):
    out, ref, summed, ref_summed = _run(n, k, group, prologue, config)
    assert out.shape == (1, n)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    if summed is not None:
        torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    assert not split_k_counters(out.device, 4).any()


@pytest.mark.parametrize("prologue", ["none", "rmsnorm"])
def test_int4_one_row_split_k_is_deterministic(prologue: str):
    """Two launches on the same inputs give the same bits (the partials are added in split order), and the
    second one finds the counters the first one reset."""
    config = GemvConfig(block_n=8, block_k=128, num_warps=1, num_stages=1, split_k=4, one_row=True)
    first = _run(21, 512, 128, prologue, config)[0]
    second = _run(21, 512, 128, prologue, config)[0]
    assert torch.equal(first, second)
    assert not split_k_counters(first.device, 3).any()


def test_int4_one_row_tiles():
    """Splits drop until each is whole periods, tiles halve until they divide a split."""
    assert one_row_tiles(14336, 128, GemvConfig(block_k=1024, split_k=7)) == (8, 2, 7)  # down: 16 periods a split
    assert one_row_tiles(4096, 128, GemvConfig(block_k=1024, split_k=3)) == (8, 2, 2)  # 3 splits: not whole periods
    assert one_row_tiles(512, 64, GemvConfig(block_k=4096)) == (8, 1, 1)  # the tile shrinks to K


def test_int4_one_row_kernel_at_one_row():
    """One row runs the one-row kernel: TUNED_INT4's configs on Llama-3-8B's four projections (groups of 128), the
    rule of thumb's elsewhere (one K tile a program, split past 4,096); several rows, and a K that no tile of
    1,024-4,096 divides, keep the tile kernel."""
    tuned = {(n, k, prologue) for (n, k, prologue, rows), config in TUNED_INT4.items() if rows == 1}
    assert {(n, k) for n, k, _ in tuned} == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    for n, k, prologue in tuned:
        assert int4_config(k, 1, 128, n, prologue) is TUNED_INT4[(n, k, prologue, 1)]
        assert not int4_config(k, 8, 128, n, prologue).one_row
    rule = int4_config(14336, 1, 64, 4096, 0)  # groups of 64: not tuned
    assert rule.one_row and (rule.block_k, rule.num_warps, rule.split_k) == (2048, 2, 7)
    assert int4_config(3584, 1, 128, 4608, 1).one_row is False  # 3,584: no tile of 1,024-4,096 divides it
    assert int4_config(2048, 1, 128, 2048, 0) == GemvConfig(
        block_n=16, block_k=2048, num_warps=2, num_stages=1, one_row=True
    )


def test_int4_one_row_fixed_point_keeps_a_wide_range_of_activations():
    """Each period holds an outlier of 3e4 beside values down to 1e-5. Rounded to 2^-15 of their period's largest
    |x|, the small values err by less than int4 weights do on the outlier's own term, and the output stays as
    close to the fp32 reference as the fp32 kernel's was (2.8-3.2e-3 on seeds 7-9; bf16 rounding alone ~1.9e-3).
    Without the low bytes (8-bit fixed point) it is off by ~0.4."""
    gen = torch.Generator().manual_seed(7)
    n, k, group = 48, 1024, 128
    weight = _weight(n, k, group, gen)
    x = torch.randn(1, k, generator=gen) * 10 ** torch.randint(-5, 2, (1, k), generator=gen).float()
    x[0, ::128] = 3e4
    x = x.to(torch.bfloat16)
    config = GemvConfig(block_n=16, block_k=512, num_stages=1, one_row=True)
    out = gemv(x, weight, config=config).float()
    ref = gemv_ref(x.float(), weight)[0].float()
    assert (out - ref).norm() / ref.norm() < 4e-3


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int4_one_row_gemv_propagates_nan_and_inf(bad: float):
    gen = torch.Generator().manual_seed(8)
    weight = _weight(16, 512, 128, gen)
    x = torch.randn(1, 512, generator=gen).to(torch.float16)
    x[0, 200] = bad
    out = gemv(x, weight, config=GemvConfig(block_n=16, block_k=512, num_stages=1, one_row=True))
    assert out.isnan().all()
