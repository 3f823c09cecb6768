"""Which GEMV config a launch runs: the tuned one of its shape (tgi_compat/kernels/gemv/tuned.py), else a rule of
thumb; and whether a product is few-row enough for the GEMV at all."""

from __future__ import annotations

import dataclasses

import torch
import triton

from tgi_compat.kernels.gemv.tuned import TUNED, TUNED_INT4, TUNED_ROW_SCALED
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_NONE,
    PROLOGUE_NORM_ADD_NORM,
    PROLOGUE_RMSNORM,
    WEIGHT_DENSE,
    WEIGHT_INT4,
    WEIGHT_ROW_SCALED,
    GemvConfig,
    QuantizedWeight,
)
from tgi_compat.kernels.quant.int4_layout import int4_period
from tgi_compat.kernels.widening import tuned_for

# Quantized weights take the GEMV up to this many rows (the existing GEMM paths above it); a dense
# weight only at one row, where it beats cuBLAS. Measured on an H100 (BENCHMARKS.md): at 8 rows the
# fp8/int8 GEMV falls below _scaled_mm / dequant_matmul (25% vs 31% of bandwidth), at 4 it is ahead
# (42% vs 30%); the int4 GEMV beats dequant_matmul at every row count up to 8 (9.5% vs 3%).
MAX_QUANTIZED_ROWS = 8
MAX_ROW_SCALED_ROWS = 4

# fp32 accumulator elements a thread may hold ([rows, BLOCK_N, K tile] / threads) before spilling
_MAX_ACC_PER_THREAD = 64


def gemv_config(
    n: int, k: int, prologue: int, weight_format: int = WEIGHT_DENSE, num_rows: int = 1, group_size: int = 128
) -> GemvConfig | None:
    """The tuned config of this shape, else a rule of thumb; None: do not fuse (dense weights only).

    Quantized weights move 1 or 1/2 byte per weight, so their tiles hold twice the rows (the same
    bytes per step); several rows shrink the K tile so that the [rows, BLOCK_N, K tile] fp32
    accumulator stays in registers."""
    if weight_format == WEIGHT_INT4:
        return int4_config(k, num_rows, group_size, n, prologue)
    if weight_format == WEIGHT_DENSE and num_rows == 1 and (n, k, prologue) in TUNED:
        return TUNED[(n, k, prologue)]
    # An FP8 / int8 shape widened by LoRA's folded A keeps its base shape's entry (tgi_compat.kernels.widening):
    # 3.948 ms against 4.080 a batch-1 step of an FP8 Llama-3-8B with 8 slots of r = 16 (H100, 2026-12-06). A dense
    # one does not: the rule of thumb read the widened bf16 shapes faster (5.755 against 5.931 ms a step).
    if weight_format == WEIGHT_ROW_SCALED and num_rows == 1:
        found, row_scaled = tuned_for(TUNED_ROW_SCALED, (n, k, prologue), n_index=0)
        if found:
            return row_scaled
    return rule_of_thumb_config(k, prologue, weight_format, num_rows)


def rule_of_thumb_config(k: int, prologue: int, weight_format: int = WEIGHT_DENSE, num_rows: int = 1) -> GemvConfig:
    """A shape's config where no sweep has chosen one (dense and 1-byte weights)."""
    block_k = next((b for b in (1024, 512, 256, 128) if k % b == 0), 512)
    block_n = 8 if prologue in (PROLOGUE_RMSNORM, PROLOGUE_NORM_ADD_NORM) else 4
    if weight_format != WEIGHT_DENSE:
        block_n *= 2
    config = GemvConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=1)
    return fit_rows(config, num_rows)


def int4_config(k: int, num_rows: int, group_size: int, n: int = 0, prologue: int = PROLOGUE_NONE) -> GemvConfig:
    """The tuned config of this shape (groups of 128), else the int4 kernels' rule of thumb.

    At one row: the one-row kernel (tgi_compat/kernels/gemv/int4_one_row.py), 16 rows a program (TUNED_INT4's run 8
    to 32) over a K tile of 1,024 features a warp (4 warps at 4,096, fewer where that does not divide K), K split
    into such tiles past 4,096 (down's 14,336: 7 tiles of 2,048); the tile kernel where no such tile divides K. On an
    H100 (BENCHMARKS.md, thirteenth session) the rule read 1.5-3.6x faster than the tile kernel on seven untuned
    shapes (Llama-3-8B's in groups of 64, Llama-2-13B's q|k|v, o and gate|up), at 44-63% of the copy bandwidth
    against 17-31%. Several rows: the tile kernel, 8 weight rows, 4 warps, the widest K tile that does not
    spill."""
    block_m = triton.next_power_of_2(num_rows)
    tuned = TUNED_INT4.get((n, k, prologue, block_m)) if group_size == 128 else None
    if tuned is not None:
        return tuned
    period = int4_period(group_size)
    if block_m == 1:  # the one-row kernel: one K tile a program
        for width in (4096, 2048, 1024):
            if width % period == 0 and k % width == 0:
                split_k = k // width if k > 4096 else 1
                return GemvConfig(
                    block_n=16, block_k=width, num_warps=width // 1024, num_stages=1, split_k=split_k, one_row=True
                )
    config = GemvConfig(block_n=8, block_k=period, num_warps=4, num_stages=1)
    for width in (2048, 1024, 512, 256, 128):
        if width % period == 0 and k % width == 0 and int4_register_estimate(config, num_rows, width) <= 160:
            return dataclasses.replace(config, block_k=width)
    return config


def int4_register_estimate(config: GemvConfig, num_rows: int, block_k: int | None = None) -> int:
    """Registers a thread of the int4 kernel takes, estimated from sm_90 compiles (scripts/gemv_resources.py,
    2026-11-24) for w words of the weight tile a thread holds. At one row with 1,024 features a warp (x's
    layout is the tile's) ~5 a word (16 words: 80, 32: 168). Otherwise ~4 a word for the tile and its
    products, plus ~4 a row of x for the accumulator, plus ~30 (16 words at one row: 128; 32: 255 and
    spilled; 4 words at 8 rows: 168-177). Above ~200 the kernel spills."""
    block_k = block_k or config.block_k
    words = config.block_n * block_k // 8 // (32 * config.num_warps)
    if num_rows == 1 and block_k == 1024 * config.num_warps:
        return 5 * words + 8
    return words * (4 * triton.next_power_of_2(num_rows) + 4) + 30


def fit_rows(config: GemvConfig, num_rows: int) -> GemvConfig:
    """`config` with its K tile shrunk until the accumulator of `num_rows` rows fits."""
    block_m = triton.next_power_of_2(num_rows)
    if block_m == 1:
        return config
    budget = _MAX_ACC_PER_THREAD * 32 * config.num_warps
    block_k = config.block_k
    while block_k > 64 and block_m * config.block_n * block_k > budget:
        block_k //= 2
    return dataclasses.replace(config, block_k=block_k)


def gemv_config_for(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, prologue: int) -> GemvConfig | None:
    """The GEMV's config when x is few enough fp16/bf16 rows on CUDA for `weight` (one row of a
    dense weight, up to MAX_QUANTIZED_ROWS of a quantized one) and the shape is worth it; else None."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    n, k = weight.shape
    if isinstance(weight, torch.Tensor):
        return gemv_config(n, k, prologue) if x.shape[0] == 1 else None
    max_rows = MAX_ROW_SCALED_ROWS if weight.format == WEIGHT_ROW_SCALED else MAX_QUANTIZED_ROWS
    if weight.format == WEIGHT_INT4 and prologue == PROLOGUE_NORM_ADD_NORM:
        return None  # the int4 kernel has no such prologue
    if x.shape[0] > max_rows or (weight.format == WEIGHT_INT4 and not is_power_of_2(weight.group_size)):
        return None
    return gemv_config(n, k, prologue, weight.format, x.shape[0], weight.group_size)


def is_power_of_2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
