"""The one-row int4 GEMV (decode at batch 1): `GemvConfig.one_row` selects it, kernels.gemv.TUNED_INT4 for
Llama-3-8B's four projections. An H100 sweep (BENCHMARKS.md, twelfth session) found it faster than the
row-walking kernel it replaced on every one: q|k|v 9.2 against 14.3 us, o 6.3 against 9.8, gate|up 29.6 against
30.2, down 19.7 against 20.8.

Each program owns `block_n` output rows and a K slice of `block_k * tiles` features:

- the weight tile is loaded as 2-D [block_n, words] int32 and reshaped to [block_n, periods, words]. From a 3-D
  load Triton 3.6 (the one torch 2.11 ships) spread the threads over the rows, so that every thread held 4
  periods of x: 255 registers and spills on sm_90, 32% of DRAM bandwidth (Nsight Compute). The 2-D load
  spreads the threads along the words, 4 (one 16-byte load) a thread: 1,024 features a warp, all block_n rows in
  each thread's registers, 96-168 registers;
- x's nibble slices are read with a contiguity of 4 (`_four_runs`) so that their layout is the words' own and
  no conversion goes through shared memory; f(x) (RMSNorm with the residual sum, SiLU/GeLU-mul) is computed
  once for the program's block_n rows;
- the nibbles are unpacked two a shift: nibbles 2j and 2j+1 go to bits 12..15 and 16..19 of one word, under the
  exponents of 1 and 1/16 (one three-input logic instruction each), and meet x in one FMA a weight; the per-period
  sums give sum(q x), the scale and the zero point are applied once a period.

K is split over `split_k` programs where N / block_n leaves SMs idle (kernels.gemv._reduce_split_k adds them).
A split of several tiles walks them in a software-pipelined loop (`num_stages`); the tuned configs use one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dequant_matmul import int4_period
from kernels.gemv import (
    PROLOGUE_NORM_ADD_NORM,
    GemvConfig,
    QuantizedWeight,
    _reduce_split_k,
    _store_output,
    _store_residual_sum,
    _word_offset,
    int4_operands,
    split_k_scratch,
)
from kernels.pdl import launch_options
from kernels.silu_mul import gated_activation


@triton.jit
def _four_runs(offs):
    """offs with its contiguity seen as 4: x's loads then take the 4-element vectors a thread of the words'
    layout holds (16-byte words, 8-byte bf16 runs), not 8 that would need a conversion."""
    return (offs // 4) * 4 + offs % 4


@triton.jit
def _activation(x_ptr, residual_ptr, norm_weight_ptr, offs_k, K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """(f(x) at offs_k in fp32 before the 1/rms scale, its squares for the RMS)."""
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:
        h = tl.load(x_ptr + offs_k)
        if HAS_RESIDUAL:  # rounded to x's dtype, as an unfused residual add would store it
            h = (h.to(tl.float32) + tl.load(residual_ptr + offs_k).to(tl.float32)).to(dtype)
        hf = h.to(tl.float32)
        return hf * tl.load(norm_weight_ptr + offs_k).to(tl.float32), hf * hf
    if PROLOGUE == 2 or PROLOGUE == 3:  # rounded to x's dtype as kernels/silu_mul.py stores it
        gate = tl.load(x_ptr + offs_k).to(tl.float32)
        up = tl.load(x_ptr + offs_k + K).to(tl.float32)
        xk = gated_activation(gate, up, PROLOGUE == 3).to(dtype).to(tl.float32)
        return xk, xk
    xk = tl.load(x_ptr + offs_k).to(tl.float32)
    return xk, xk


@triton.jit
def _gemv_int4_one_row_kernel(
    x_ptr,  # [1, K], or [1, 2K] for SILU_MUL
    residual_ptr,  # [1, K], read when HAS_RESIDUAL
    residual_out_ptr,  # [1, K], receives x + residual when HAS_RESIDUAL
    norm_weight_ptr,  # [K], RMSNORM only
    w_ptr,  # int32 [N, K/8], interleaved in periods of PERIOD features (kernels.dequant_matmul)
    scale_ptr,  # [N, K/G]
    zero_ptr,  # [N, K/G], same strides as scale
    bias_ptr,  # [N], when HAS_BIAS
    out_ptr,  # [1, N]
    partial_ptr,  # fp32 [programs along N, SPLIT_K, 1, BLOCK_N + 1] when SPLIT_K > 1 (kernels.gemv._reduce_split_k)
    counter_ptr,  # int32 [programs along N], zero between launches, when SPLIT_K > 1
    N,
    K,
    stride_wn,
    stride_sn,
    eps,
    one_bits,  # 0x3F800000 (1.0), an argument so that mask and OR are one LOP3 (kernels.dequant_matmul.int4_as_float)
    sixteenth_bits,  # 0x3D800000 (1/16), likewise
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PERIOD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output rows a program
    PERIODS: tl.constexpr,  # periods a tile
    TILES: tl.constexpr,  # tiles a split (K / SPLIT_K / (PERIODS * PERIOD))
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    TILE_K: tl.constexpr = PERIODS * PERIOD
    W: tl.constexpr = PERIOD // 8
    k_begin = tl.program_id(1) * (TILES * TILE_K)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)  # rows past N read row 0; their results are not stored
    offs_p = tl.arange(0, PERIODS)
    offs_w = tl.arange(0, W)
    # loaded [BLOCK_N, PERIODS * W] and reshaped: see the module's docstring
    word_ptrs = w_ptr + rows[:, None] * stride_wn + tl.arange(0, PERIODS * W)[None, :]
    x_offs = offs_p[:, None] * PERIOD + _four_runs(offs_w)[None, :]  # [P, W]: nibble 0's features in a tile
    group_offs = rows[:, None] * stride_sn + (offs_p * PERIOD // GROUP_SIZE)[None, :]  # [BLOCK_N, P]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    offs_m = tl.arange(0, 1)
    if HAS_RESIDUAL:
        if pid + tl.program_id(1) == 0:
            _store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, offs_m, offs_m == 0, 0, K)

    acc = tl.zeros([BLOCK_N, PERIODS], dtype=tl.float32)
    squares = tl.zeros([PERIODS, W], dtype=tl.float32)
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        k0 = k_begin + t * TILE_K
        words = tl.reshape(tl.load(word_ptrs + _word_offset(k0, PERIOD)), (BLOCK_N, PERIODS, W))
        dot = tl.zeros([BLOCK_N, PERIODS, W], dtype=tl.float32)
        # nibbles 2j and 2j+1 shifted together to bits 12..15 and 16..19, under the exponents of 1 and 1/16:
        # f = 1 + q / 2^11 (even) and 1/16 + q / 2^11 (odd), so sum(f x) = x_even + x_odd / 16 + sum(q x) / 2^11
        x_even = tl.zeros([PERIODS, W], dtype=tl.float32)
        x_odd = tl.zeros([PERIODS, W], dtype=tl.float32)
        for j in tl.static_range(4):
            if j < 2:
                bits = words << (12 - 8 * j)
            else:
                bits = words >> (8 * j - 12)  # arithmetic on a negative word: the masks drop the sign bits
            for odd in tl.static_range(2):
                xi, sq = _activation(
                    x_ptr, residual_ptr, norm_weight_ptr, k0 + x_offs + (2 * j + odd) * W, K, PROLOGUE,
                    HAS_RESIDUAL,
                )  # fmt: skip
                if odd:
                    dot += ((bits & 0xF0000) | sixteenth_bits).to(tl.float32, bitcast=True) * xi[None, :, :]
                    x_odd += xi
                else:
                    dot += ((bits & 0xF000) | one_bits).to(tl.float32, bitcast=True) * xi[None, :, :]
                    x_even += xi
                if PROLOGUE == 1:
                    squares += sq
        x_sum = tl.sum(x_even + x_odd, 1)[None, :]
        q_dot = 2048.0 * (tl.sum(dot, 2) - tl.sum(x_even + 0.0625 * x_odd, 1)[None, :])  # sum(q x) a period
        # sum (q - z) s x = s sum(q x) - z s sum(x) a period
        scale = tl.load(scale_ptr + group_offs + k0 // GROUP_SIZE).to(tl.float32)
        zero = tl.load(zero_ptr + group_offs + k0 // GROUP_SIZE).to(tl.float32)
        acc += scale * (q_dot - zero * x_sum)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    y = tl.sum(acc, 1)[None, :]  # [1, BLOCK_N]
    sq = tl.sum(tl.sum(squares, 1), 0)[None]
    if SPLIT_K > 1:
        y, sq, last = _reduce_split_k(y, sq, partial_ptr, counter_ptr, pid, offs_m, SPLIT_K, 1, BLOCK_N)
        if last:
            _store_output(
                y, sq, scale_ptr, bias_ptr, out_ptr, rows, offs_n, mask_n, offs_m, offs_m == 0, K, stride_sn, 0,
                eps, PROLOGUE, False, HAS_BIAS,
            )  # fmt: skip
    else:
        _store_output(
            y, sq, scale_ptr, bias_ptr, out_ptr, rows, offs_n, mask_n, offs_m, offs_m == 0, K, stride_sn, 0, eps,
            PROLOGUE, False, HAS_BIAS,
        )  # fmt: skip


def one_row_tiles(k: int, group_size: int, config: GemvConfig) -> tuple[int, int, int]:
    """(periods a tile, tiles a split, splits) that `config` runs with on K: splits halved until each is a whole
    number of periods (lowered one at a time: any count is fine), the tile (config.block_k features, at least a
    period, a power of two of periods) halved until it divides a split."""
    period = int4_period(group_size)
    split_k = config.split_k
    while split_k > 1 and k % (split_k * period):
        split_k -= 1
    periods = max(1, config.block_k // period)
    while (k // split_k) % (periods * period):
        periods //= 2
    return periods, k // split_k // (periods * period), split_k


def launch_int4_one_row(
    common: tuple,  # (x, residual, residual_out, norm_weight), unused ones any tensor
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [1, N]
    eps: float,
    prologue: int,
    has_residual: bool,
    config: GemvConfig,
    pdl: bool,
) -> None:
    """`_gemv_int4_one_row_kernel` over one row of x, config.block_n rows a program."""
    x = common[0]
    (m, n), k = out.shape, weight.shape[1]
    assert m == 1, "the one-row int4 GEMV takes one row of x"
    assert prologue != PROLOGUE_NORM_ADD_NORM, "the int4 kernels have no NORM_ADD_NORM prologue"
    periods, tiles, split_k = one_row_tiles(k, weight.group_size, config)
    programs = triton.cdiv(n, config.block_n)
    partial, counters = split_k_scratch(x, programs, split_k, config.block_n + 1)
    _gemv_int4_one_row_kernel[(programs, split_k)](
        *common,
        *int4_operands(weight, bias, out, partial, counters),
        n,
        k,
        weight.data.stride(0),
        weight.scale.stride(0),
        eps,
        0x3F800000,
        0x3D800000,
        PROLOGUE=prologue,
        HAS_RESIDUAL=has_residual,
        HAS_BIAS=bias is not None,
        GROUP_SIZE=weight.group_size,
        PERIOD=int4_period(weight.group_size),
        BLOCK_N=config.block_n,
        PERIODS=periods,
        TILES=tiles,
        SPLIT_K=split_k,
        NUM_STAGES=config.num_stages,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        **launch_options(pdl),
    )
