"""The int4 GEMV's tile kernel: [BLOCK_N, periods, words] int32 tiles of tgi_compat/kernels/quant/int4_layout.py's
interleaved layout, any number of rows of x (one row at a time runs tgi_compat/kernels/gemv/int4_one_row.py where
the config says so).

Nibble i of a tile's words is a contiguous run of features, so each nibble is one shift and one mask against a
contiguous slice of x, and the tile's threads spread over K rather than over the rows (each activation is computed
once a program). A nibble becomes the float 1 + q/16 without a conversion instruction (its bits under 1.0's
exponent), and its scale and zero point are applied once per word position. K may be split over several programs
per column (`GemvConfig.split_k`: more programs where N / BLOCK_N is small against the SMs; the last program of a
column adds the partials, in split order, and resets its counter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.elementwise.silu_mul import gated_activation
from tgi_compat.kernels.gemv.epilogue import reduce_split_k, store_output
from tgi_compat.kernels.gemv.prologue import store_residual_sum
from tgi_compat.kernels.gemv.types import Activations, GemvConfig, QuantizedWeight
from tgi_compat.kernels.pdl import launch_options
from tgi_compat.kernels.quant.int4_layout import int4_as_float, int4_period
from tgi_compat.kernels.split_k import split_k_scratch


@triton.jit
def _activation_tile(x_rows, offs_k, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """`activation_block` (tgi_compat/kernels/gemv/prologue.py) over a [P, W] tile of features (no masks: int4 K
    tiles divide K): [BLOCK_M, P, W]. x_rows: (x_ptr, residual_ptr, norm_weight_ptr, rows_m, stride_xm, K)."""
    x_ptr, residual_ptr, norm_weight_ptr, rows_m, stride_xm, K = x_rows
    x_ptrs = x_ptr + rows_m[:, None, None] * stride_xm + offs_k[None, :, :]
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:
        h = tl.load(x_ptrs)
        if HAS_RESIDUAL:  # rounded to x's dtype, as an unfused residual add would store it
            r_offs = rows_m[:, None, None] * K + offs_k[None, :, :]
            h = (h.to(tl.float32) + tl.load(residual_ptr + r_offs).to(tl.float32)).to(dtype)
        hf = h.to(tl.float32)
        xk = hf * tl.load(norm_weight_ptr + offs_k).to(tl.float32)[None, :, :]
        squares = hf * hf
    elif PROLOGUE == 2 or PROLOGUE == 3:
        gate = tl.load(x_ptrs).to(tl.float32)
        up = tl.load(x_ptrs + K).to(tl.float32)
        xk = gated_activation(gate, up, PROLOGUE == 3).to(dtype).to(tl.float32)
        squares = xk  # unused
    else:
        xk = tl.load(x_ptrs).to(tl.float32)
        squares = xk  # unused
    return xk, squares


@triton.jit
def _fma_rows3(acc, w, xk, BLOCK_M: tl.constexpr):
    """acc + w * x per row of x: [BLOCK_N, P, W] += w * x (one row), [BLOCK_M, BLOCK_N, P, W] += w[None] * x[:, None]."""
    if BLOCK_M == 1:
        out = acc + w * xk
    else:
        out = acc + w[None, :, :, :] * xk[:, None, :, :]
    return out


@triton.jit
def word_offset(k, PERIOD: tl.constexpr):
    """The word offset of feature k, a multiple of the period, as the compiler must know it: division loses the
    divisibility its alignment analysis tracks, and without it the tile's loads are split into 32-bit ones
    (sm_90 PTX: `ld.global.b32` instead of `ld.global.v4.b32`)."""
    return tl.multiple_of(k // 8, PERIOD // 8)


@triton.jit
def _int4_tile(
    acc,  # [(BLOCK_M,) BLOCK_N, P, W] fp32
    sum_sq,  # [BLOCK_M, P, W] fp32
    words,  # [BLOCK_N, P, W] int32: one K tile of P periods of W words
    k0,
    x_rows,  # (x_ptr, residual_ptr, norm_weight_ptr, rows_m, stride_xm, K)
    quant,  # (scale_ptr, zero_ptr, one_bits, rows, stride_sn, offs_p, offs_w)
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PERIOD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """acc += the tile's (q - zero) * scale * x, elementwise over [(BLOCK_M,) BLOCK_N, P, W].

    With f = 1 + q/16 (what `int4_as_float` gives), (q - z) s x = 16 s (f x) - (16 + z) s x. A period lies
    in one group, so per word position the eight nibbles' f x are summed first (one FMA a weight) and the
    scale and zero point are applied once per word position: 16 s * sum(f x) - (16 + z) s * sum(x)."""
    scale_ptr, zero_ptr, one_bits, rows, stride_sn, offs_p, offs_w = quant
    k0 = tl.multiple_of(k0, PERIOD)  # (see word_offset) so that x's loads are vectorized too
    groups = (k0 + offs_p * PERIOD) // GROUP_SIZE  # [P]
    group_offs = rows[:, None] * stride_sn + groups[None, :]  # [BLOCK_N, P]
    scale = tl.load(scale_ptr + group_offs).to(tl.float32)
    zero = tl.load(zero_ptr + group_offs).to(tl.float32)
    scale16 = (16.0 * scale)[:, :, None]
    correction = (-(16.0 + zero) * scale)[:, :, None]
    offs_k = k0 + offs_p[:, None] * PERIOD + offs_w[None, :]  # [P, W]: the features of nibble 0
    dot = tl.zeros_like(acc)
    x_sum = tl.zeros_like(sum_sq)
    for i in tl.static_range(8):
        xk, squares = _activation_tile(x_rows, offs_k + i * (PERIOD // 8), PROLOGUE, HAS_RESIDUAL)
        dot = _fma_rows3(dot, int4_as_float(words, one_bits, i), xk, BLOCK_M)
        x_sum += xk
        if PROLOGUE == 1:
            sum_sq += squares
    if BLOCK_M == 1:
        acc += scale16 * dot + correction * x_sum
    else:
        acc += scale16[None, :, :, :] * dot + correction[None, :, :, :] * x_sum[:, None, :, :]
    return acc, sum_sq


@triton.jit
def _gemv_int4_kernel(
    x_ptr,  # [M, K], or [M, 2K] for SILU_MUL; row stride stride_xm
    residual_ptr,  # [M, K] contiguous, read when HAS_RESIDUAL
    residual_out_ptr,  # [M, K] contiguous, receives x + residual when HAS_RESIDUAL
    norm_weight_ptr,  # [K], RMSNORM only
    w_ptr,  # int32 [N, K/8], interleaved in periods of PERIOD features (tgi_compat.kernels.quant.dequant_matmul)
    scale_ptr,  # [N, K/G]
    zero_ptr,  # [N, K/G], same strides as scale
    bias_ptr,  # [N], when HAS_BIAS
    out_ptr,  # [M, N], row stride stride_om
    partial_ptr,  # fp32 [programs along N, SPLIT_K, BLOCK_M, BLOCK_N + 1] when SPLIT_K > 1 (see _reduce_split_k)
    counter_ptr,  # int32 [programs along N], zero between launches, when SPLIT_K > 1
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    eps,
    one_bits,  # 0x3F800000, the bits of 1.0 (see tgi_compat.kernels.quant.dequant_matmul.int4_as_float)
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PERIOD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of PERIOD dividing K / SPLIT_K
    SPLIT_K: tl.constexpr,  # programs along K (grid axis 1), each walking K / SPLIT_K features
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The int4 GEMV: each K tile is read as [BLOCK_N, periods, words] int32, so nibble i of the tile's words
    meets a contiguous [periods, words] slice of x, and the tile's threads spread over the periods and
    words (not over the BLOCK_N rows): each activation is computed once per program. With SPLIT_K > 1 the K
    walk is shared by SPLIT_K programs (more programs in flight where N / BLOCK_N is small against the SMs)
    and the last of them to finish adds the partial sums (`_reduce_split_k`)."""
    pid = tl.program_id(0)
    k_begin = tl.program_id(1) * (K // SPLIT_K)
    k_end = k_begin + K // SPLIT_K
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_m = tl.where(mask_m, offs_m, 0)
    offs_p = tl.arange(0, BLOCK_K // PERIOD)
    offs_w = tl.arange(0, PERIOD // 8)
    word_offs = offs_p[:, None] * (PERIOD // 8) + offs_w[None, :]  # [P, W]: the tile's words, contiguous
    word_ptrs = w_ptr + rows[:, None, None] * stride_wn + word_offs[None, :, :]

    words = tl.load(word_ptrs + word_offset(k_begin, PERIOD))  # before the wait, as in the dense kernel
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if HAS_RESIDUAL:
        if pid + tl.program_id(1) == 0:
            store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    x_rows = (x_ptr, residual_ptr, norm_weight_ptr, rows_m, stride_xm, K)
    quant = (scale_ptr, zero_ptr, one_bits, rows, stride_sn, offs_p, offs_w)
    if PREFETCH:  # the next tile's loads are issued before this tile's arithmetic
        for k0 in range(k_begin, k_end, BLOCK_K):
            next_words = words
            if k0 + BLOCK_K < k_end:
                next_words = tl.load(word_ptrs + word_offset(k0 + BLOCK_K, PERIOD))
            acc, sum_sq = _int4_tile(
                acc, sum_sq, words, k0, x_rows, quant, PROLOGUE, HAS_RESIDUAL, GROUP_SIZE, PERIOD, BLOCK_M
            )
            words = next_words
    else:
        acc, sum_sq = _int4_tile(
            acc, sum_sq, words, k_begin, x_rows, quant, PROLOGUE, HAS_RESIDUAL, GROUP_SIZE, PERIOD, BLOCK_M
        )
        for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
            words = tl.load(word_ptrs + word_offset(k0, PERIOD))
            acc, sum_sq = _int4_tile(
                acc, sum_sq, words, k0, x_rows, quant, PROLOGUE, HAS_RESIDUAL, GROUP_SIZE, PERIOD, BLOCK_M
            )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if BLOCK_M == 1:
        y = tl.sum(tl.sum(acc, 2), 1)[None, :]
    else:
        y = tl.sum(tl.sum(acc, 3), 2)
    sq = tl.sum(tl.sum(sum_sq, 2), 1)
    out_tile = (out_ptr, offs_m, mask_m, offs_n, mask_n, stride_om)
    if SPLIT_K > 1:
        y, sq, last = reduce_split_k(y, sq, partial_ptr, counter_ptr, pid, offs_m, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            store_output(y, sq, out_tile, rows, scale_ptr, stride_sn, bias_ptr, K, eps, PROLOGUE, False, HAS_BIAS)
    else:
        store_output(y, sq, out_tile, rows, scale_ptr, stride_sn, bias_ptr, K, eps, PROLOGUE, False, HAS_BIAS)


def launch_int4(
    acts: Activations,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, N]
    eps: float,
    prologue: int,
    has_residual: bool,
    config: GemvConfig,
    pdl: bool,
) -> None:
    """`_gemv_int4_kernel` over (N / block_n, splits) programs."""
    x = acts.x
    (m, n), k = out.shape, weight.shape[1]
    block_k, split_k = int4_launch_tiles(k, weight.group_size, config)
    block_m, programs = triton.next_power_of_2(m), triton.cdiv(n, config.block_n)
    partial, counters = split_k_scratch(x, programs, split_k, block_m * (config.block_n + 1))
    _gemv_int4_kernel[(programs, split_k)](
        *acts,
        *int4_operands(weight, bias, out, partial, counters),
        m,
        n,
        k,
        x.stride(0),
        weight.data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        eps,
        0x3F800000,
        PROLOGUE=prologue,
        HAS_RESIDUAL=has_residual,
        HAS_BIAS=bias is not None,
        GROUP_SIZE=weight.group_size,
        PERIOD=int4_period(weight.group_size),
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PREFETCH=config.prefetch,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )


def int4_operands(
    weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor, partial: torch.Tensor, counters: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """The int4 kernels' tensors after x's four: words, scales, zeros, bias (out stands in when there is none), out,
    the split-K partials and counters."""
    return weight.data, weight.scale, weight.zero, bias if bias is not None else out, out, partial, counters


def int4_launch_tiles(k: int, group_size: int, config: GemvConfig) -> tuple[int, int]:
    """(K tile, splits) the int4 kernel runs `config` with: splits halved until each is a whole number of
    periods, the tile widened to a period and halved until it divides a split (K divides by the period)."""
    period = int4_period(group_size)
    split_k = config.split_k
    while split_k > 1 and k % (split_k * period):
        split_k //= 2
    block_k = max(config.block_k, period)
    while (k // split_k) % block_k:
        block_k //= 2
    return block_k, split_k
