"""The one-row int4 GEMV that walks many output rows a program with the activations held in registers
(`GemvConfig.rows_per_program`: kernels.gemv.TUNED_INT4 selects it where an H200 sweep found it faster, Llama-3-8B's
four one-row projections).

Nsight Compute showed the tile kernel (`_gemv_int4_kernel`, 4 weight rows a program) bound by L1/shared memory,
not DRAM: every program re-read (and re-laid out) the whole 8 KB activation vector for 8 KB of packed weights.
Here a program loads its K slice of f(x) once, as eight [periods, words] fp32 tiles (one a nibble: nibble i of
a period's words is a contiguous run of features, kernels.dequant_matmul's layout), and then walks
`rows_per_program` output rows, `block_n` at a time: each [block_n, periods, words] tile of weight words meets
those tiles elementwise, with the threads spread over periods and words (rows in registers), so x's tiles are
the words' own layout and no conversion goes through shared memory. The number of warps follows the slice
(1,024 features a warp, the shape where that holds on sm_90). Where N / rows_per_program programs leave SMs idle,
K is split over `split_k` programs and the last of a column adds the partials (kernels.gemv._reduce_split_k).

A slice that is not a power of two of periods (down's 14,336 features over 4 splits: 28) is padded to one and
masked. Prologues: none, RMSNorm (with the residual sum; 1/rms applied at the end, as in the tile kernel) and
SiLU/GeLU-mul; each activation is computed once a program, not once a row group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dequant_matmul import int4_as_float, int4_period
from kernels.gemv import (
    PROLOGUE_NORM_ADD_NORM,
    GemvConfig,
    QuantizedWeight,
    _reduce_split_k,
    _store_output,
    _store_residual_sum,
    _word_offset,
    int4_launch_tiles,
    split_k_scratch,
)
from kernels.pdl import launch_options
from kernels.silu_mul import gated_activation


@triton.jit
def _x_nibble(
    x_ptr, residual_ptr, norm_weight_ptr, offs_k, mask, K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):
    """(f(x) at offs_k [P, W] in fp32 before the 1/rms scale, its squares for the RMS), 0 where masked."""
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:
        h = tl.load(x_ptr + offs_k, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # rounded to x's dtype, as an unfused residual add would store it
            h = (h.to(tl.float32) + tl.load(residual_ptr + offs_k, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        hf = h.to(tl.float32)
        xk = hf * tl.load(norm_weight_ptr + offs_k, mask=mask, other=0.0).to(tl.float32)
        squares = hf * hf
    elif PROLOGUE == 2 or PROLOGUE == 3:  # rounded to x's dtype as kernels/silu_mul.py stores it
        gate = tl.load(x_ptr + offs_k, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + offs_k + K, mask=mask, other=0.0).to(tl.float32)
        xk = gated_activation(gate, up, PROLOGUE == 3).to(dtype).to(tl.float32)
        squares = xk  # unused
    else:
        xk = tl.load(x_ptr + offs_k, mask=mask, other=0.0).to(tl.float32)
        squares = xk  # unused
    return xk, squares


@triton.jit
def _clamped(rows, N):
    """Rows past N read row 0 (their results are not stored) instead of masking the weight loads."""
    return tl.where(rows < N, rows, 0).to(tl.int64)


@triton.jit
def _load_words(w_ptr, rows, stride_wn, word_offs, mask_p, EVEN: tl.constexpr):
    """[BLOCK_N, P, W] words of `rows` (clamped in range) at the slice's word offsets [P, W]."""
    ptrs = w_ptr + rows[:, None, None] * stride_wn + word_offs[None, :, :]
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask_p[None, :, None], other=0)


@triton.jit
def _row_group_dot(words, xs, x_period, one_bits, scale_ptr, zero_ptr, rows, groups, mask_p, stride_sn):
    """[BLOCK_N] dot products of a row group's words with the slice: per period, with f = 1 + q/16,
    sum (q - z) s x = 16 s sum(f x) - (16 + z) s sum(x), the eight nibbles' f x summed first (one FMA a weight)."""
    dot = int4_as_float(words, one_bits, 0) * xs[0][None, :, :]
    for i in tl.static_range(1, 8):
        dot += int4_as_float(words, one_bits, i) * xs[i][None, :, :]
    group_offs = rows[:, None] * stride_sn + groups[None, :]  # [BLOCK_N, P]
    scale = tl.load(scale_ptr + group_offs, mask=mask_p[None, :], other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + group_offs, mask=mask_p[None, :], other=0.0).to(tl.float32)
    per_period = 16.0 * scale * tl.sum(dot, 2) - (16.0 + zero) * scale * x_period[None, :]
    return tl.sum(per_period, 1)


@triton.jit
def _gemv_int4_rows_kernel(
    x_ptr,  # [1, K], or [1, 2K] for SILU_MUL
    residual_ptr,  # [1, K], read when HAS_RESIDUAL
    residual_out_ptr,  # [1, K], receives x + residual when HAS_RESIDUAL
    norm_weight_ptr,  # [K], RMSNORM only
    w_ptr,  # int32 [N, K/8], interleaved in periods of PERIOD features (kernels.dequant_matmul)
    scale_ptr,  # [N, K/G]
    zero_ptr,  # [N, K/G], same strides as scale
    bias_ptr,  # [N], when HAS_BIAS
    out_ptr,  # [1, N]
    partial_ptr,  # fp32 [programs along N, SPLIT_K, 1, ROWS + 1] when SPLIT_K > 1 (kernels.gemv._reduce_split_k)
    counter_ptr,  # int32 [programs along N], zero between launches, when SPLIT_K > 1
    N,
    K,
    stride_wn,
    stride_sn,
    eps,
    one_bits,  # 0x3F800000 (see kernels.dequant_matmul.int4_as_float)
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PERIOD: tl.constexpr,
    ROWS: tl.constexpr,  # output rows a program, a multiple of BLOCK_N
    BLOCK_N: tl.constexpr,  # rows a step of the walk
    PERIODS: tl.constexpr,  # periods in a K slice (K / SPLIT_K / PERIOD)
    BLOCK_P: tl.constexpr,  # PERIODS padded to a power of two
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next row group's words before this one's arithmetic
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    k_begin = tl.program_id(1) * (PERIODS * PERIOD)
    EVEN: tl.constexpr = PERIODS == BLOCK_P
    W: tl.constexpr = PERIOD // 8
    offs_p = tl.arange(0, BLOCK_P)
    offs_w = tl.arange(0, W)
    mask_p = offs_p < PERIODS
    word_offs = _word_offset(k_begin, PERIOD) + offs_p[:, None] * W + offs_w[None, :]  # [P, W]
    offs_g = tl.arange(0, BLOCK_N)
    words = _load_words(w_ptr, _clamped(pid * ROWS + offs_g, N), stride_wn, word_offs, mask_p, EVEN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the activations below are the previous kernel's output
    offs_m = tl.arange(0, 1)
    if HAS_RESIDUAL:
        if pid + tl.program_id(1) == 0:
            _store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, offs_m, offs_m == 0, 0, K)

    # f(x) over the slice, once: nibble i of word [p, w] is feature k_begin + p * PERIOD + i * W + w
    offs_k = k_begin + offs_p[:, None] * PERIOD + offs_w[None, :]
    mask_k = mask_p[:, None] & (offs_w < W)[None, :]
    x0, sq0 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    x1, sq1 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k + W, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    x2, sq2 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k + 2 * W, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    x3, sq3 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k + 3 * W, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    x4, sq4 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k + 4 * W, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    x5, sq5 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k + 5 * W, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    x6, sq6 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k + 6 * W, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    x7, sq7 = _x_nibble(x_ptr, residual_ptr, norm_weight_ptr, offs_k + 7 * W, mask_k, K, PROLOGUE, HAS_RESIDUAL)
    xs = (x0, x1, x2, x3, x4, x5, x6, x7)
    x_period = tl.sum(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, 1)  # [P]: sum(x) a period, for the zero points
    sq = tl.zeros([1], dtype=tl.float32)
    if PROLOGUE == 1:
        sq += tl.sum(sq0 + sq1 + sq2 + sq3 + sq4 + sq5 + sq6 + sq7)
    groups = (k_begin + offs_p * PERIOD) // GROUP_SIZE  # [P]

    offs_s = tl.arange(0, ROWS // BLOCK_N)
    y = tl.zeros([ROWS // BLOCK_N, BLOCK_N], dtype=tl.float32)
    for g in range(0, ROWS, BLOCK_N):
        rows_g = _clamped(pid * ROWS + g + offs_g, N)
        if PREFETCH:  # two row groups' words in flight
            next_words = words
            if g + BLOCK_N < ROWS:
                next_words = _load_words(
                    w_ptr, _clamped(pid * ROWS + g + BLOCK_N + offs_g, N), stride_wn, word_offs, mask_p, EVEN
                )
        elif g > 0:
            words = _load_words(w_ptr, rows_g, stride_wn, word_offs, mask_p, EVEN)
        y_g = _row_group_dot(words, xs, x_period, one_bits, scale_ptr, zero_ptr, rows_g, groups, mask_p, stride_sn)
        # its row of [groups, BLOCK_N] results, kept in the reduction's own layout (a [ROWS] vector of results
        # took a shared-memory round trip a row group: 6 barriers a step on sm_90, 4 this way)
        y += tl.where(offs_s[:, None] == g // BLOCK_N, y_g[None, :], 0.0)
        if PREFETCH:
            words = next_words
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    offs_n = pid * ROWS + tl.arange(0, ROWS)
    mask_n = offs_n < N
    rows = _clamped(offs_n, N)
    y2 = tl.reshape(y, [1, ROWS])
    if SPLIT_K > 1:
        y2, sq, last = _reduce_split_k(y2, sq, partial_ptr, counter_ptr, pid, offs_m, SPLIT_K, 1, ROWS)
        if last:
            _store_output(
                y2, sq, scale_ptr, bias_ptr, out_ptr, rows, offs_n, mask_n, offs_m, offs_m == 0, K, stride_sn, 0,
                eps, PROLOGUE, False, HAS_BIAS,
            )  # fmt: skip
    else:
        _store_output(
            y2, sq, scale_ptr, bias_ptr, out_ptr, rows, offs_n, mask_n, offs_m, offs_m == 0, K, stride_sn, 0, eps,
            PROLOGUE, False, HAS_BIAS,
        )  # fmt: skip


def launch_int4_rows(
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
    """`_gemv_int4_rows_kernel` over one row of x with `config.rows_per_program` rows a program."""
    x = common[0]
    (m, n), k = out.shape, weight.shape[1]
    assert m == 1, "the int4 row-walking GEMV takes one row of x"
    assert prologue != PROLOGUE_NORM_ADD_NORM, "the int4 kernels have no NORM_ADD_NORM prologue"
    rows, block_n = config.rows_per_program, config.block_n
    assert rows % block_n == 0 and triton.next_power_of_2(rows) == rows, (rows, block_n)
    period = int4_period(weight.group_size)
    _, split_k = int4_launch_tiles(k, weight.group_size, config)
    periods = k // split_k // period
    block_p = triton.next_power_of_2(periods)
    programs = triton.cdiv(n, rows)
    partial, counters = split_k_scratch(x, programs, split_k, rows + 1)
    _gemv_int4_rows_kernel[(programs, split_k)](
        *common,
        weight.data,
        weight.scale,
        weight.zero,
        bias if bias is not None else x,
        out,
        partial,
        counters,
        n,
        k,
        weight.data.stride(0),
        weight.scale.stride(0),
        eps,
        0x3F800000,
        PROLOGUE=prologue,
        HAS_RESIDUAL=has_residual,
        HAS_BIAS=bias is not None,
        GROUP_SIZE=weight.group_size,
        PERIOD=period,
        ROWS=rows,
        BLOCK_N=block_n,
        PERIODS=periods,
        BLOCK_P=block_p,
        SPLIT_K=split_k,
        PREFETCH=config.prefetch,
        USE_PDL=pdl,
        num_warps=max(1, min(8, block_p * period // 1024)),  # 1,024 features a warp: x's layout is the words'
        num_stages=1,
        **launch_options(pdl),
    )
