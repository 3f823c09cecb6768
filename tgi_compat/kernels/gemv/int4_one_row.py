"""The one-row int4 GEMV (decode at batch 1): `GemvConfig.one_row` selects it, tgi_compat.kernels.gemv.tuned.TUNED_INT4 for
Llama-3-8B's four projections.

Each program owns `block_n` output rows and a K slice of `block_k * tiles` features:

- the weight tile is loaded as 2-D [block_n, words] int32 and reshaped to [block_n, periods, words]. From a 3-D
  load Triton 3.6 (the one torch 2.11 ships) spread the threads over the rows, so that every thread held 4
  periods of x: 255 registers and spills on sm_90, 32% of DRAM bandwidth (Nsight Compute). The 2-D load
  spreads the threads along the words, 4 (one 16-byte load) a thread: 1,024 features a warp;
- x's nibble slices are read with a contiguity of 4 (`_four_runs`) so that their layout is the words' own and
  no conversion goes through shared memory; f(x) (RMSNorm with the residual sum, SiLU/GeLU-mul) is computed
  once for the program's block_n rows;
- the products are integer byte dot products (PTX dp4a, four multiply-adds an instruction). A period's f(x) is
  put in 16-bit fixed point under one power of two (2^14 <= its largest |f(x)| times it < 2^15) and split into a
  signed high and an unsigned low byte; a word's even and odd nibbles, masked into bytes, meet the bytes of
  their features in four dp4a. sum((q - z) fixed(f(x))) is exact in int32; the scale, the zero point and the
  power of two are applied once a period in fp32. Rounding f(x) to 16 bits under its period's largest value
  errs by at most 2^-15 of that value an element, far below the bf16 output's rounding (2^-9).

  Why integers: an fp32 product a weight needs its nibble in its own register (a LOP3 a weight, and a shift
  for two), and the integer pipe that runs those issues at half the FMA rate. Compiled for sm_90 (Triton 3.6),
  gate|up's 16 x 4,096 tile took 1,800 instructions a thread, 830 of them on that pipe; with dp4a 1,160 and
  about 470 (benchmarks/gemv_resources.py). On an H100 (BENCHMARKS.md, thirteenth session) that, with the row blocks
  (8 to 32 rows a program) it makes the fastest, took the four Llama-3-8B GEMVs from 64.8 to 57.2 us a layer.

K is split over `split_k` programs where N / block_n leaves SMs idle (tgi_compat.kernels.gemv.epilogue.reduce_split_k adds them).
A split of several tiles walks them in a software-pipelined loop (`num_stages`); the tuned configs use one tile.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.elementwise.silu_mul import gated_activation
from tgi_compat.kernels.gemv.epilogue import reduce_split_k, store_output
from tgi_compat.kernels.gemv.int4 import int4_operands, word_offset
from tgi_compat.kernels.gemv.prologue import store_residual_sum
from tgi_compat.kernels.gemv.types import PROLOGUE_NORM_ADD_NORM, Activations, GemvConfig, QuantizedWeight
from tgi_compat.kernels.pdl import launch_options
from tgi_compat.kernels.quant.int4_layout import int4_period
from tgi_compat.kernels.split_k import split_k_scratch


@triton.jit
def _four_runs(offs):
    """offs with its contiguity seen as 4: x's loads then take the 4-element vectors a thread of the words'
    layout holds (16-byte words, 8-byte bf16 runs), not 8 that would need a conversion."""
    return (offs // 4) * 4 + offs % 4


@triton.jit
def _activation(x_src, offs_k, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """(f(x) at offs_k in fp32 before the 1/rms scale, its squares for the RMS). x_src: (x_ptr, residual_ptr,
    norm_weight_ptr, K)."""
    x_ptr, residual_ptr, norm_weight_ptr, K = x_src
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:
        h = tl.load(x_ptr + offs_k)
        if HAS_RESIDUAL:  # rounded to x's dtype, as an unfused residual add would store it
            h = (h.to(tl.float32) + tl.load(residual_ptr + offs_k).to(tl.float32)).to(dtype)
        hf = h.to(tl.float32)
        return hf * tl.load(norm_weight_ptr + offs_k).to(tl.float32), hf * hf
    if PROLOGUE == 2 or PROLOGUE == 3:  # rounded to x's dtype as tgi_compat/kernels/elementwise/silu_mul.py stores it
        gate = tl.load(x_ptr + offs_k).to(tl.float32)
        up = tl.load(x_ptr + offs_k + K).to(tl.float32)
        xk = gated_activation(gate, up, PROLOGUE == 3).to(dtype).to(tl.float32)
        return xk, xk
    xk = tl.load(x_ptr + offs_k).to(tl.float32)
    return xk, xk


# Triton's interpreter runs no inline PTX: there the byte dot products are spelled out (same integers).
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _dp4a(a, b, acc, B_SIGNED: tl.constexpr):
    """acc + the dot product of a's four bytes (unsigned) with b's (signed where B_SIGNED): PTX dp4a."""
    if _INTERPRETED:
        out = acc
        for i in tl.static_range(4):
            if B_SIGNED:
                b_i = (b << (24 - 8 * i)) >> 24
            else:
                b_i = (b >> (8 * i)) & 0xFF
            out += ((a >> (8 * i)) & 0xFF) * b_i
    else:
        asm: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;" if B_SIGNED else "dp4a.u32.u32 $0, $1, $2, $3;"
        out = tl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, acc], dtype=tl.int32, is_pure=True, pack=1)
    return out


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pack_bytes(b0, b1, b2, b3):
    """The low bytes of four int32 tensors as the bytes of one."""
    return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | (b3 << 24)


@triton.jit
def _fixed_point(x, scale):
    """round(x * scale) as int32 (|x * scale| < 2^22): the sum's low bits hold it under an exponent of 2^23."""
    return (x * scale + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _accumulate_tile(
    acc,
    squares,
    words,
    scale,
    zero,
    k0,
    x_src,
    x_offs,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    W: tl.constexpr,
):
    """acc [BLOCK_N, PERIODS] += the tile's sum((q - z) s f(x)) a period; squares += f(x)'s squares (RMSNORM).
    In integers (see the module's docstring): f(x) in 16-bit fixed point a period, its high and low bytes against
    each word's even and odd nibbles in four dp4a."""
    x0, sq0 = _activation(x_src, k0 + x_offs, PROLOGUE, HAS_RESIDUAL)
    x1, sq1 = _activation(x_src, k0 + x_offs + W, PROLOGUE, HAS_RESIDUAL)
    x2, sq2 = _activation(x_src, k0 + x_offs + 2 * W, PROLOGUE, HAS_RESIDUAL)
    x3, sq3 = _activation(x_src, k0 + x_offs + 3 * W, PROLOGUE, HAS_RESIDUAL)
    x4, sq4 = _activation(x_src, k0 + x_offs + 4 * W, PROLOGUE, HAS_RESIDUAL)
    x5, sq5 = _activation(x_src, k0 + x_offs + 5 * W, PROLOGUE, HAS_RESIDUAL)
    x6, sq6 = _activation(x_src, k0 + x_offs + 6 * W, PROLOGUE, HAS_RESIDUAL)
    x7, sq7 = _activation(x_src, k0 + x_offs + 7 * W, PROLOGUE, HAS_RESIDUAL)
    if PROLOGUE == 1:
        squares += ((sq0 + sq1) + (sq2 + sq3)) + ((sq4 + sq5) + (sq6 + sq7))
    top_0123 = _max_nan(_max_nan(tl.abs(x0), tl.abs(x1)), _max_nan(tl.abs(x2), tl.abs(x3)))
    top_4567 = _max_nan(_max_nan(tl.abs(x4), tl.abs(x5)), _max_nan(tl.abs(x6), tl.abs(x7)))
    top = _max_nan(top_0123, top_4567)
    # the exponent of the period's largest |f(x)|, + 127 (255: an inf or a NaN)
    biased = (tl.reduce(top, 1, _max_nan).to(tl.int32, bitcast=True) >> 23) & 0xFF
    to_fixed_p = (tl.minimum(268 - biased, 254) << 23).to(tl.float32, bitcast=True)  # [P]: 2^(14 - exponent)
    to_fixed = to_fixed_p[:, None]
    i0 = _fixed_point(x0, to_fixed)
    i1 = _fixed_point(x1, to_fixed)
    i2 = _fixed_point(x2, to_fixed)
    i3 = _fixed_point(x3, to_fixed)
    i4 = _fixed_point(x4, to_fixed)
    i5 = _fixed_point(x5, to_fixed)
    i6 = _fixed_point(x6, to_fixed)
    i7 = _fixed_point(x7, to_fixed)
    high_even = _pack_bytes(i0 >> 8, i2 >> 8, i4 >> 8, i6 >> 8)[None, :, :]
    high_odd = _pack_bytes(i1 >> 8, i3 >> 8, i5 >> 8, i7 >> 8)[None, :, :]
    low_even = _pack_bytes(i0, i2, i4, i6)[None, :, :]
    low_odd = _pack_bytes(i1, i3, i5, i7)[None, :, :]
    x_sum = tl.sum(((i0 + i1) + (i2 + i3)) + ((i4 + i5) + (i6 + i7)), 1)  # [P]: sum(fixed f(x)) a period
    even = words & 0x0F0F0F0F  # nibbles 0, 2, 4, 6 as bytes
    odd = (words >> 4) & 0x0F0F0F0F  # 1, 3, 5, 7 (the mask drops an arithmetic shift's sign bits)
    dot = _dp4a(odd, high_odd, _dp4a(even, high_even, tl.zeros(words.shape, tl.int32), True), True) << 8
    dot = _dp4a(odd, low_odd, _dp4a(even, low_even, dot, False), False)
    q_dot = tl.sum(dot, 2)  # [BLOCK_N, P]: sum(q fixed(x)) a period, |.| < 2^26
    from_fixed = tl.where(biased == 255, float("nan"), 1.0 / to_fixed_p)[None, :]  # an inf or NaN in f(x): NaN
    q_z_dot = q_dot.to(tl.float32) - zero.to(tl.float32) * x_sum.to(tl.float32)[None, :]  # sum((q - z) fixed(x))
    return acc + scale.to(tl.float32) * from_fixed * q_z_dot, squares


@triton.jit
def _gemv_int4_one_row_kernel(
    x_ptr,  # [1, K], or [1, 2K] for SILU_MUL
    residual_ptr,  # [1, K], read when HAS_RESIDUAL
    residual_out_ptr,  # [1, K], receives x + residual when HAS_RESIDUAL
    norm_weight_ptr,  # [K], RMSNORM only
    w_ptr,  # int32 [N, K/8], interleaved in periods of PERIOD features (tgi_compat.kernels.quant.int4_layout)
    scale_ptr,  # [N, K/G]
    zero_ptr,  # [N, K/G], same strides as scale
    bias_ptr,  # [N], when HAS_BIAS
    out_ptr,  # [1, N]
    partial_ptr,  # fp32 [programs along N, SPLIT_K, 1, BLOCK_N + 1] when SPLIT_K > 1 (tgi_compat.kernels.gemv.epilogue.reduce_split_k)
    counter_ptr,  # int32 [programs along N], zero between launches, when SPLIT_K > 1
    N,
    K,
    stride_wn,
    stride_sn,
    eps,
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
            store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, offs_m, offs_m == 0, 0, K)

    acc = tl.zeros([BLOCK_N, PERIODS], dtype=tl.float32)
    squares = tl.zeros([PERIODS, W], dtype=tl.float32)
    x_src = (x_ptr, residual_ptr, norm_weight_ptr, K)
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        k0 = k_begin + t * TILE_K
        words = tl.reshape(tl.load(word_ptrs + word_offset(k0, PERIOD)), (BLOCK_N, PERIODS, W))
        scale = tl.load(scale_ptr + group_offs + k0 // GROUP_SIZE)
        zero = tl.load(zero_ptr + group_offs + k0 // GROUP_SIZE)
        acc, squares = _accumulate_tile(acc, squares, words, scale, zero, k0, x_src, x_offs, PROLOGUE, HAS_RESIDUAL, W)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    y = tl.sum(acc, 1)[None, :]  # [1, BLOCK_N]
    sq = tl.sum(tl.sum(squares, 1), 0)[None]
    if SPLIT_K > 1:
        y, sq, last = reduce_split_k(y, sq, partial_ptr, counter_ptr, pid, offs_m, SPLIT_K, 1, BLOCK_N)
        if last:
            out_tile = (out_ptr, offs_m, offs_m == 0, offs_n, mask_n, 0)
            store_output(y, sq, out_tile, rows, scale_ptr, stride_sn, bias_ptr, K, eps, PROLOGUE, False, HAS_BIAS)
    else:
        out_tile = (out_ptr, offs_m, offs_m == 0, offs_n, mask_n, 0)
        store_output(y, sq, out_tile, rows, scale_ptr, stride_sn, bias_ptr, K, eps, PROLOGUE, False, HAS_BIAS)


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
    acts: Activations,
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
    x = acts.x
    (m, n), k = out.shape, weight.shape[1]
    assert m == 1, "the one-row int4 GEMV takes one row of x"
    assert prologue != PROLOGUE_NORM_ADD_NORM, "the int4 kernels have no NORM_ADD_NORM prologue"
    periods, tiles, split_k = one_row_tiles(k, weight.group_size, config)
    programs = triton.cdiv(n, config.block_n)
    partial, counters = split_k_scratch(x, programs, split_k, config.block_n + 1)
    _gemv_int4_one_row_kernel[(programs, split_k)](
        *acts,
        *int4_operands(weight, bias, out, partial, counters),
        n,
        k,
        weight.data.stride(0),
        weight.scale.stride(0),
        eps,
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
