"""Few-row matrix-vector product (decode at batch 1 to ~8) with the preceding elementwise op fused in,
reading a half-precision weight or a quantized one that it dequantizes in registers.

At small batch a decoder layer is four weight reads (q|k|v, o, gate|up, down) separated by small
elementwise kernels (RMSNorm with the residual add, SiLU-and-mul). Those kernels move almost no bytes
but each costs a launch and a gap in the CUDA graph; fused into the GEMV's prologue they cost nothing:

    PROLOGUE_NONE      y = W x
    PROLOGUE_RMSNORM   y = W rmsnorm(x [+ residual])   (x + residual also written out, by program 0)
    PROLOGUE_SILU_MUL  y = W (silu(x[:K]) * x[K:])
    PROLOGUE_GELU_TANH_MUL  y = W (gelu_tanh(x[:K]) * x[K:])   (Gemma's GeGLU)
    PROLOGUE_NORM_ADD_NORM  y = W rmsnorm(residual + rmsnorm(x, w1))   (Gemma 2/3's post-sublayer norm, the
                       residual add and the next pre-norm; residual + rmsnorm(x, w1) also written out)

The weight is read in one of three formats (`QuantizedWeight` describes the quantized ones):

    WEIGHT_DENSE       W [N, K] fp16/bf16/fp32
    WEIGHT_ROW_SCALED  W [N, K] int8 or float8_e4m3fn, w[n, k] = W[n, k] * scale[n] (per channel; a
                       scale of stride 0 is per tensor)
    WEIGHT_INT4        W int32 [N, K/8], eight nibbles a word in tgi_compat.kernels.quant.dequant_matmul's interleaved
                       layout, w[n, k] = (q[n, k] - zero[n, k/G]) * scale[n, k/G], integer zero points

Weight-only: activations stay in their half precision, so reading 1 or 1/2 byte per weight instead of
2 is the whole gain at these row counts. Each program owns BLOCK_N output rows and walks the whole K
once, so there is no split-K reduction; the prologue is recomputed per program from L2 (K elements per
row of x, against BLOCK_N * K weight elements from HBM). RMSNorm needs the row's sum of squares, which
is only known at the end of the walk: the kernel accumulates W (h * norm_weight) and scales by 1/rms
afterwards (a scalar per row commutes with the dot product). So in half precision it skips the unfused
path's two intermediate roundings of the normed activation (tgi_compat/kernels/elementwise/rmsnorm.py); the result is the more
exact one and within the dtype's tolerance of it. NORM_ADD_NORM needs x's own 1/rms before its main loop:
each program first reads x's row once from L2 for it, then runs RMSNORM's loop on residual + rmsnorm(x, w1),
rounded to the dtype where the unfused norm and add store their outputs. SiLU-and-mul rounds its output
to the input dtype like tgi_compat/kernels/elementwise/silu_mul.py. Accumulation is fp32, elementwise over the K block (one row)
or over [rows, K block] (several), reduced once at the end.

Two kernels share those helpers. `_gemv_kernel` reads [BLOCK_N, BLOCK_K] tiles of any weight (a one-row
variant for 1-byte weights with [BLOCK_N, BLOCK_K/16, 16] tiles was swept against it on an H100 and lost in
every pair that mattered, so it is gone). `_gemv_int4_kernel` reads [BLOCK_N, periods, 16] words: nibble i of the words is a contiguous run of
features, so each nibble is one shift and one mask against a contiguous slice of x, and the tile's
threads spread over K rather than over the rows (each activation is computed once a program). It can split
K over several programs per column (`GemvConfig.split_k`: more programs where N / BLOCK_N is small against
the SMs; the last program of a column adds the partials, in split order, and resets its counter). Its
few weight rows a program make the fused prologue a large share of its instructions, so a config may run
the prologue as its own kernel instead (`GemvConfig.separate_prologue`, any weight format).
At one row a config may instead select tgi_compat/kernels/gemv/int4_one_row.py (`GemvConfig.one_row`): 2-D weight loads
(the layout Triton 3.6 gives a 3-D one spills), integer products (dp4a against x in 16-bit fixed point).

Integers become floats without a conversion instruction (a quarter-rate pipe that would bound the
int8/int4 kernels): OR-ing a value 0 <= v < 2^23 into the mantissa of 2^23 gives the float 2^23 + v,
and subtracting 2^23 (plus int8's +128 bias) is exact; an int4 nibble goes to the mantissa's top bits
under 1.0's exponent (1 + q/16), and its scale and zero point are applied once per word position.

On Hopper the kernel is launched as a programmatic dependent (PDL) of the kernel before it: it reads
its first weight block, then waits for that kernel's output, and lets the next kernel start once its
own main loop is done, so consecutive GEMVs overlap one's tail with the next one's first reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.comm.one_shot_all_reduce import PushTarget, push_kernel_args, push_to_peers
from tgi_compat.kernels.elementwise import rmsnorm as rmsnorm_module
from tgi_compat.kernels.elementwise import silu_mul as silu_mul_module
from tgi_compat.kernels.elementwise.silu_mul import gated_activation
from tgi_compat.kernels.pdl import launch_options, use_pdl
from tgi_compat.kernels.quant.dequant_matmul import int4_as_float, int4_period, unpack_int4

PROLOGUE_NONE = 0
PROLOGUE_RMSNORM = 1
PROLOGUE_SILU_MUL = 2
PROLOGUE_GELU_TANH_MUL = 3
PROLOGUE_NORM_ADD_NORM = 4

WEIGHT_DENSE = 0
WEIGHT_ROW_SCALED = 1
WEIGHT_INT4 = 2

# Quantized weights take the GEMV up to this many rows (the existing GEMM paths above it); a dense
# weight only at one row, where it beats cuBLAS. Measured on an H100 (BENCHMARKS.md): at 8 rows the
# fp8/int8 GEMV falls below _scaled_mm / dequant_matmul (25% vs 31% of bandwidth), at 4 it is ahead
# (42% vs 30%); the int4 GEMV beats dequant_matmul at every row count up to 8 (9.5% vs 3%).
MAX_QUANTIZED_ROWS = 8
MAX_ROW_SCALED_ROWS = 4


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _activation_block(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    x_norm_weight_ptr,
    x_inv_rms,  # [BLOCK_M] fp32: 1/rms of x's rows (NORM_ADD_NORM)
    rows_m,
    mask_m,
    stride_xm,
    offs_k,
    K,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """(f(x)[rows, offs_k] in fp32 (before the 1/rms scale), [BLOCK_M, len(offs_k)]; its squares for the RMS)."""
    mask_k = offs_k < K
    mask = mask_m[:, None] & mask_k[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1 or PROLOGUE == 4:
        h = _load(x_ptrs, mask, EVEN_K)
        if PROLOGUE == 4:
            h = _x_normed(h, x_inv_rms, _load(x_norm_weight_ptr + offs_k, mask_k, EVEN_K))
        if HAS_RESIDUAL:  # rounded to x's dtype, as an unfused residual add would store it
            r_offs = rows_m[:, None] * K + offs_k[None, :]
            h = (h.to(tl.float32) + _load(residual_ptr + r_offs, mask, EVEN_K).to(tl.float32)).to(dtype)
        hf = h.to(tl.float32)
        xk = hf * _load(norm_weight_ptr + offs_k, mask_k, EVEN_K).to(tl.float32)[None, :]
        squares = hf * hf
    elif PROLOGUE == 2 or PROLOGUE == 3:  # rounded to x's dtype as tgi_compat/kernels/elementwise/silu_mul.py stores it
        gate = _load(x_ptrs, mask, EVEN_K).to(tl.float32)
        up = _load(x_ptrs + K, mask, EVEN_K).to(tl.float32)
        xk = gated_activation(gate, up, PROLOGUE == 3).to(dtype).to(tl.float32)
        squares = xk  # unused
    else:
        xk = _load(x_ptrs, mask, EVEN_K).to(tl.float32)
        squares = xk  # unused
    return xk, squares


@triton.jit
def _x_normed(x, x_inv_rms, x_norm_weight):
    """rmsnorm(x) * w1 of a [rows, K block] tile given x's 1/rms per row, with tgi_compat/kernels/elementwise/rmsnorm.py's roundings:
    normalised in fp32, rounded to x's dtype, scaled, rounded again (the unfused norm's stored output)."""
    normed = (x.to(tl.float32) * x_inv_rms[:, None]).to(x.dtype)
    weight = x_norm_weight.to(tl.float32)[None, :]
    return rmsnorm_module.mul_uncontracted(normed.to(tl.float32), weight).to(x.dtype)  # not fused into the add


@triton.jit
def _inv_rms_rows(x_ptr, rows_m, mask_m, stride_xm, K, eps, X_BLOCK: tl.constexpr):
    """1/rms of each row of x [rows, K] (NORM_ADD_NORM's first norm), read X_BLOCK features at a time: the
    whole row at once when it fits, so that it costs one L2 round trip before the main loop, not one a slice."""
    sum_sq = tl.zeros_like(rows_m).to(tl.float32)
    for k0 in range(0, K, X_BLOCK):
        offs_k = k0 + tl.arange(0, X_BLOCK)
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        xf = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(xf * xf, 1)
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def _store_normed_residual_sum(
    x_ptr, x_norm_weight_ptr, x_inv_rms, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K
):
    """NORM_ADD_NORM's residual_out = residual + rmsnorm(x, w1), as `_activation_block` computes it."""
    for k0 in range(0, K, 256):
        offs_k = k0 + tl.arange(0, 256)
        mask_k = offs_k < K
        mask = mask_m[:, None] & mask_k[None, :]
        r_offs = rows_m[:, None] * K + offs_k[None, :]
        h = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        h = _x_normed(h, x_inv_rms, tl.load(x_norm_weight_ptr + offs_k, mask=mask_k, other=0.0))
        h = h.to(tl.float32) + tl.load(residual_ptr + r_offs, mask=mask).to(tl.float32)
        tl.store(residual_out_ptr + r_offs, h.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K):
    """residual_out = x + residual rounded to x's dtype, as the prologue computes it (one program writes it,
    in a pass of its own: a store inside the main loop would keep later weight loads from being hoisted)."""
    for k0 in range(0, K, 256):  # small tiles: this pass must not raise the kernel's register count
        offs_k = k0 + tl.arange(0, 256)
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        r_offs = rows_m[:, None] * K + offs_k[None, :]
        h = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=mask).to(tl.float32)
        h += tl.load(residual_ptr + r_offs, mask=mask).to(tl.float32)
        tl.store(residual_out_ptr + r_offs, h.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weight_tile(w_ptr, rows, stride_wn, offs_c, num_cols, EVEN_K: tl.constexpr):
    """[BLOCK_N, len(offs_c)] stored elements (rows are clamped in range, so only columns are masked)."""
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_c[None, :]
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(offs_c < num_cols)[None, :], other=0.0)


@triton.jit
def _fma_rows(acc, w, xk, BLOCK_M: tl.constexpr):
    """acc + w * x per row of x: [BLOCK_N, C] += w * x[0] (one row), [BLOCK_M, BLOCK_N, C] += w[None] * x[:, None]."""
    # one return: Triton's compiler rejects returns of different shapes, even under a constexpr branch
    if BLOCK_M == 1:
        out = acc + w * xk
    else:
        out = acc + w[None, :, :] * xk[:, None, :]
    return out


@triton.jit
def _int8_to_float(w):
    """Exact int8 -> fp32 without a conversion instruction: 0x4B000080 + v is the float 2^23 + 128 + v."""
    return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _accumulate_block(
    acc,
    sum_sq,
    w,  # the block's stored tile, already loaded
    k0,
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    x_norm_weight_ptr,
    x_inv_rms,
    rows_m,
    mask_m,
    offs_c,
    K,
    stride_xm,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    xk, squares = _activation_block(
        x_ptr,
        residual_ptr,
        norm_weight_ptr,
        x_norm_weight_ptr,
        x_inv_rms,
        rows_m,
        mask_m,
        stride_xm,
        k0 + offs_c,
        K,
        PROLOGUE,
        HAS_RESIDUAL,
        EVEN_K,
    )
    if w.dtype == tl.int8:
        wf = _int8_to_float(w)
    else:
        wf = w.to(tl.float32)
    acc = _fma_rows(acc, wf, xk, BLOCK_M)
    if PROLOGUE == 1 or PROLOGUE == 4:
        sum_sq += squares
    return acc, sum_sq


@triton.jit
def _store_output(
    y,  # [BLOCK_M, BLOCK_N] fp32, before the 1/rms and per-channel scales
    sum_sq,  # [BLOCK_M] sums of squares of the normed rows (RMSNORM)
    scale_ptr,
    bias_ptr,
    out_ptr,
    rows,
    offs_n,
    mask_n,
    offs_m,
    mask_m,
    K,
    stride_sn,
    stride_om,
    eps,
    PROLOGUE: tl.constexpr,
    ROW_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    if PROLOGUE == 1 or PROLOGUE == 4:  # 1/rms is one scalar per row: it commutes with the dot product
        y *= (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    if ROW_SCALED:  # so is the per-channel scale
        y *= tl.load(scale_ptr + rows * stride_sn).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    stored = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, stored, mask=mask_m[:, None] & mask_n[None, :])
    return stored


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], or [M, 2K] for SILU_MUL; row stride stride_xm
    residual_ptr,  # [M, K] contiguous, read when HAS_RESIDUAL
    residual_out_ptr,  # [M, K] contiguous, receives x + residual when HAS_RESIDUAL (never aliases residual)
    norm_weight_ptr,  # [K], RMSNORM and NORM_ADD_NORM
    x_norm_weight_ptr,  # [K], NORM_ADD_NORM only: x's own norm
    w_ptr,  # [N, K], row stride stride_wn, columns contiguous
    scale_ptr,  # [N] (row-scaled; stride_sn 0: per tensor)
    bias_ptr,  # [N], when HAS_BIAS
    out_ptr,  # [M, N], row stride stride_om
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    eps,
    x_eps,  # NORM_ADD_NORM: x's norm's epsilon
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_SCALED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x, padded to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next weight tile before this one's arithmetic
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the previous kernel (Hopper)
    X_BLOCK: tl.constexpr,  # NORM_ADD_NORM: features of x a step of its 1/rms pass reads
    push_buffer_ptrs,  # PUSH: tgi_compat.kernels.comm.one_shot_all_reduce.PushTarget's buffers and halves (else any tensor)
    push_halves_ptr,
    push_capacity,
    PUSH: tl.constexpr,  # send the output to the other ranks' all-reduce buffers as it is stored
    PUSH_RANK: tl.constexpr,
    PUSH_WORLD: tl.constexpr,
    PUSH_BLOCK: tl.constexpr,  # the all-reduce's elements a program
    SENTINEL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)  # clamp instead of masking the weight loads
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_m = tl.where(mask_m, offs_m, 0)  # padding rows recompute row 0 and are not stored
    offs_c = tl.arange(0, BLOCK_K)

    # The first weight tile is read before waiting on the previous kernel: no kernel writes
    # weights, so under programmatic dependent launch this read overlaps that kernel's tail.
    w = _weight_tile(w_ptr, rows, stride_wn, offs_c, K, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the activations below are the previous kernel's output
    x_inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 4:
        x_inv_rms = _inv_rms_rows(x_ptr, rows_m, mask_m, stride_xm, K, x_eps, X_BLOCK)
        if pid == 0:
            _store_normed_residual_sum(
                x_ptr, x_norm_weight_ptr, x_inv_rms, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K
            )
    elif HAS_RESIDUAL:
        if pid == 0:
            _store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    if PREFETCH:  # the next tile's loads are issued before this tile's arithmetic: two tiles in flight
        for k0 in range(0, K, BLOCK_K):
            w_next = w
            if k0 + BLOCK_K < K:
                w_next = _weight_tile(w_ptr, rows, stride_wn, k0 + BLOCK_K + offs_c, K, EVEN_K)
            acc, sum_sq = _accumulate_block(
                acc, sum_sq, w, k0, x_ptr, residual_ptr, norm_weight_ptr, x_norm_weight_ptr, x_inv_rms, rows_m,
                mask_m, offs_c, K, stride_xm, PROLOGUE, HAS_RESIDUAL, EVEN_K, BLOCK_M,
            )  # fmt: skip
            w = w_next
    else:
        acc, sum_sq = _accumulate_block(
            acc, sum_sq, w, 0, x_ptr, residual_ptr, norm_weight_ptr, x_norm_weight_ptr, x_inv_rms, rows_m, mask_m,
            offs_c, K, stride_xm, PROLOGUE, HAS_RESIDUAL, EVEN_K, BLOCK_M,
        )  # fmt: skip
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w = _weight_tile(w_ptr, rows, stride_wn, k0 + offs_c, K, EVEN_K)
            acc, sum_sq = _accumulate_block(
                acc, sum_sq, w, k0, x_ptr, residual_ptr, norm_weight_ptr, x_norm_weight_ptr, x_inv_rms, rows_m,
                mask_m, offs_c, K, stride_xm, PROLOGUE, HAS_RESIDUAL, EVEN_K, BLOCK_M,
            )  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own weight reads

    if BLOCK_M == 1:
        y = tl.sum(acc, 1)[None, :]
    else:
        y = tl.sum(acc, 2)  # [BLOCK_M, BLOCK_N]
    stored = _store_output(
        y, tl.sum(sum_sq, 1), scale_ptr, bias_ptr, out_ptr, rows, offs_n, mask_n, offs_m, mask_m, K, stride_sn,
        stride_om, eps, PROLOGUE, ROW_SCALED, HAS_BIAS,
    )  # fmt: skip
    if PUSH:  # out is [M, N] contiguous: element (m, n) is the all-reduce's m * N + n
        flat = offs_m[:, None] * N + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        push_to_peers(
            stored, flat, mask, push_buffer_ptrs, push_halves_ptr, push_capacity, PUSH_RANK, PUSH_WORLD, PUSH_BLOCK,
            SENTINEL,
        )  # fmt: skip


# --- int4 ----------------------------------------------------------------------------------------------


@triton.jit
def _activation_tile(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    rows_m,
    stride_xm,
    offs_k,  # [P, W] features
    K,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """`_activation_block` over a [P, W] tile of features (no masks: int4 K tiles divide K): [BLOCK_M, P, W]."""
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
def _word_offset(k, PERIOD: tl.constexpr):
    """The word offset of feature k, a multiple of the period, as the compiler must know it: division loses the
    divisibility its alignment analysis tracks, and without it the tile's loads are split into 32-bit ones
    (sm_90 PTX: `ld.global.b32` instead of `ld.global.v4.b32`)."""
    return tl.multiple_of(k // 8, PERIOD // 8)


@triton.jit
def _int4_tile(
    acc,
    sum_sq,
    words,  # [BLOCK_N, P, W] int32: one K tile of P periods of W words
    one_bits,
    k0,
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    scale_ptr,
    zero_ptr,
    rows,
    rows_m,
    offs_p,
    offs_w,
    K,
    stride_xm,
    stride_sn,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PERIOD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc += the tile's (q - zero) * scale * x, elementwise over [(BLOCK_M,) BLOCK_N, P, W].

    With f = 1 + q/16 (what `int4_as_float` gives), (q - z) s x = 16 s (f x) - (16 + z) s x. A period lies
    in one group, so per word position the eight nibbles' f x are summed first (one FMA a weight) and the
    scale and zero point are applied once per word position: 16 s * sum(f x) - (16 + z) s * sum(x)."""
    k0 = tl.multiple_of(k0, PERIOD)  # (see _word_offset) so that x's loads are vectorized too
    groups = (k0 + offs_p * PERIOD) // GROUP_SIZE  # [P]
    group_offs = rows[:, None] * stride_sn + groups[None, :]  # [BLOCK_N, P]
    scale = tl.load(scale_ptr + group_offs).to(tl.float32)
    zero = tl.load(zero_ptr + group_offs).to(tl.float32)
    scale16 = (16.0 * scale)[:, :, None]
    correction = (-(16.0 + zero) * scale)[:, :, None]
    offs_k = k0 + offs_p[:, None] * PERIOD + offs_w[None, :]  # [P, W]: the features of nibble 0
    if BLOCK_M == 1:
        dot = tl.zeros([BLOCK_N, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    else:
        dot = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_M, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    for i in tl.static_range(8):
        xk, squares = _activation_tile(
            x_ptr,
            residual_ptr,
            norm_weight_ptr,
            rows_m,
            stride_xm,
            offs_k + i * (PERIOD // 8),
            K,
            PROLOGUE,
            HAS_RESIDUAL,
        )
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

    words = tl.load(word_ptrs + _word_offset(k_begin, PERIOD))  # before the wait, as in _gemv_kernel
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if HAS_RESIDUAL:
        if pid + tl.program_id(1) == 0:
            _store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M, BLOCK_K // PERIOD, PERIOD // 8], dtype=tl.float32)
    if PREFETCH:  # the next tile's loads are issued before this tile's arithmetic
        for k0 in range(k_begin, k_end, BLOCK_K):
            next_words = words
            if k0 + BLOCK_K < k_end:
                next_words = tl.load(word_ptrs + _word_offset(k0 + BLOCK_K, PERIOD))
            acc, sum_sq = _int4_tile(
                acc, sum_sq, words, one_bits, k0, x_ptr, residual_ptr, norm_weight_ptr, scale_ptr, zero_ptr, rows,
                rows_m, offs_p, offs_w, K, stride_xm, stride_sn, PROLOGUE, HAS_RESIDUAL, GROUP_SIZE, PERIOD,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            words = next_words
    else:
        acc, sum_sq = _int4_tile(
            acc, sum_sq, words, one_bits, k_begin, x_ptr, residual_ptr, norm_weight_ptr, scale_ptr, zero_ptr,
            rows, rows_m, offs_p, offs_w, K, stride_xm, stride_sn, PROLOGUE, HAS_RESIDUAL, GROUP_SIZE, PERIOD,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
            words = tl.load(word_ptrs + _word_offset(k0, PERIOD))
            acc, sum_sq = _int4_tile(
                acc, sum_sq, words, one_bits, k0, x_ptr, residual_ptr, norm_weight_ptr, scale_ptr, zero_ptr, rows,
                rows_m, offs_p, offs_w, K, stride_xm, stride_sn, PROLOGUE, HAS_RESIDUAL, GROUP_SIZE, PERIOD,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if BLOCK_M == 1:
        y = tl.sum(tl.sum(acc, 2), 1)[None, :]
    else:
        y = tl.sum(tl.sum(acc, 3), 2)
    sq = tl.sum(tl.sum(sum_sq, 2), 1)
    if SPLIT_K > 1:
        y, sq, last = _reduce_split_k(y, sq, partial_ptr, counter_ptr, pid, offs_m, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            _store_output(
                y, sq, scale_ptr, bias_ptr, out_ptr, rows, offs_n, mask_n, offs_m, mask_m, K, stride_sn, stride_om,
                eps, PROLOGUE, False, HAS_BIAS,
            )  # fmt: skip
    else:
        _store_output(
            y, sq, scale_ptr, bias_ptr, out_ptr, rows, offs_n, mask_n, offs_m, mask_m, K, stride_sn, stride_om, eps,
            PROLOGUE, False, HAS_BIAS,
        )  # fmt: skip


@triton.jit
def _reduce_split_k(
    y,  # [BLOCK_M, BLOCK_N] this program's partial dot products
    sq,  # [BLOCK_M] its partial sums of squares (RMSNORM)
    partial_ptr,
    counter_ptr,
    pid_n,
    offs_m,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(the SPLIT_K programs' sums, the sums of squares, whether this program is the last of its column).

    Each program stores its partials in its own slot of the workspace, then counts itself in on its column's
    counter; the one that counts SPLIT_K adds every slot in split order (deterministic) and resets the counter
    to zero for the next launch. The barriers order the CTA's stores before the release of its count (and the
    acquire before the reads); the reads bypass L1, which is not coherent between SMs. Any number of splits (one
    load a split), so K can be split where a power of two would pad (down's 112 periods over 7)."""
    offs_c = tl.arange(0, BLOCK_N)
    row_stride: tl.constexpr = BLOCK_N + 1  # the row's BLOCK_N sums, then its sum of squares
    slot = partial_ptr + (pid_n * SPLIT_K + tl.program_id(1)) * (BLOCK_M * row_stride)
    tl.store(slot + offs_m[:, None] * row_stride + offs_c[None, :], y)
    tl.store(slot + offs_m * row_stride + BLOCK_N, sq)
    tl.debug_barrier()
    count = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
    last = count == SPLIT_K - 1
    if last:
        tl.debug_barrier()
        column = partial_ptr + pid_n * SPLIT_K * (BLOCK_M * row_stride)
        y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):  # in split order: the same bits on every launch
            rows_at = column + split * (BLOCK_M * row_stride) + offs_m * row_stride  # [BLOCK_M]
            y += tl.load(rows_at[:, None] + offs_c[None, :], cache_modifier=".cg")
            sq += tl.load(rows_at + BLOCK_N, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr + pid_n, 0)
    return y, sq, last


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight the GEMV dequantizes in registers, in the layout the quantized linear methods keep."""

    data: (
        torch.Tensor
    )  # int8 / float8_e4m3fn [N, K], or int32 [N, K/8] for int4 (tgi_compat.kernels.quant.dequant_matmul's layout)
    scale: torch.Tensor  # [N] per output channel, a single value per tensor, or [N, K/G] for int4
    zero: torch.Tensor | None = None  # int4: [N, K/G] integer zero points, same strides as scale
    group_size: int = 0  # int4: G

    @property
    def format(self) -> int:
        return WEIGHT_INT4 if self.zero is not None else WEIGHT_ROW_SCALED

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [N, K]."""
        n, cols = self.data.shape
        return n, cols * 8 if self.format == WEIGHT_INT4 else cols

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        if self.format == WEIGHT_ROW_SCALED:
            return self.data.float() * self.scale.float().reshape(-1, 1)
        assert self.zero is not None
        q = unpack_int4(self.data, int4_period(self.group_size)).float()
        zero = self.zero.float().repeat_interleave(self.group_size, 1)
        return (q - zero) * self.scale.float().repeat_interleave(self.group_size, 1)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    # issue the next weight tile's loads before this tile's arithmetic (registers: 2 tiles; _gemv_kernel and
    # _gemv_int4_kernel)
    prefetch: bool = False
    # int4: programs sharing each column's K walk (any count; halved while it does not divide K into whole
    # periods); the last to finish adds the partial sums. More programs in flight where N / block_n is small
    # against the SMs.
    split_k: int = 1
    # run the prologue (RMSNorm, SiLU/GeLU-mul) as its own kernel (tgi_compat/kernels/elementwise/rmsnorm.py, tgi_compat/kernels/elementwise/silu_mul.py) and
    # the GEMV without one: one more launch, but each activation computed once instead of once a program (the
    # int4 kernel's few weight rows a program make the fused prologue a large share of its instructions)
    separate_prologue: bool = False
    # int4 at one row: tgi_compat.kernels.gemv.int4_one_row's kernel (block_n rows a program, K tiles of block_k features)
    # instead of the tile kernel
    one_row: bool = False


# Best configs from scripts/device/tune_gemv.py on an H200, bf16, for the projections of Llama-3-8B
# and Qwen2-7B (key: N, K, prologue). None: the unfused pair (cuBLAS) was faster for that shape.
TUNED: dict[tuple[int, int, int], GemvConfig | None] = {
    (6144, 4096, PROLOGUE_RMSNORM): GemvConfig(16, 512, 4, 2),
    (4096, 4096, PROLOGUE_NONE): GemvConfig(4, 1024, 4, 1),
    (28672, 4096, PROLOGUE_RMSNORM): GemvConfig(8, 1024, 4, 1),
    (4096, 14336, PROLOGUE_SILU_MUL): GemvConfig(4, 1024, 4, 1),
    (128256, 4096, PROLOGUE_NONE): GemvConfig(2, 1024, 4, 1),
    (4608, 3584, PROLOGUE_RMSNORM): GemvConfig(4, 512, 4, 2),
    (3584, 3584, PROLOGUE_NONE): GemvConfig(4, 128, 8, 2),
    (37888, 3584, PROLOGUE_RMSNORM): GemvConfig(8, 512, 4, 4),
    (3584, 18944, PROLOGUE_SILU_MUL): None,
}

# Best 1-byte (FP8 / int8) configs at one row from scripts/device/bench_quant.py's sweep (key: N, K, prologue):
# Llama-3-8B's shapes, H100, 2026-11-24 (BENCHMARKS.md, "Quantization, third pass"); the sweep prints this literal.
TUNED_ROW_SCALED: dict[tuple[int, int, int], GemvConfig] = {
    (6144, 4096, PROLOGUE_RMSNORM): GemvConfig(block_n=16, num_stages=1),
    (4096, 4096, PROLOGUE_NONE): GemvConfig(block_k=1024, num_stages=1),
    (28672, 4096, PROLOGUE_RMSNORM): GemvConfig(block_k=1024, num_stages=1),
    (4096, 14336, PROLOGUE_SILU_MUL): GemvConfig(block_k=1024, num_stages=1),
}

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
    if weight_format == WEIGHT_ROW_SCALED and num_rows == 1 and (n, k, prologue) in TUNED_ROW_SCALED:
        return TUNED_ROW_SCALED[(n, k, prologue)]
    return rule_of_thumb_config(k, prologue, weight_format, num_rows)


def rule_of_thumb_config(k: int, prologue: int, weight_format: int = WEIGHT_DENSE, num_rows: int = 1) -> GemvConfig:
    """A shape's config where no sweep has chosen one (dense and 1-byte weights)."""
    block_k = next((b for b in (1024, 512, 256, 128) if k % b == 0), 512)
    block_n = 8 if prologue in (PROLOGUE_RMSNORM, PROLOGUE_NORM_ADD_NORM) else 4
    if weight_format != WEIGHT_DENSE:
        block_n *= 2
    config = GemvConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=1)
    return fit_rows(config, num_rows)


# Best int4 configs (groups of 128) from scripts/device/bench_quant.py's sweeps, keyed (N, K, prologue, rows of x
# padded to a power of two): Llama-3-8B's shapes. The one-row entries run tgi_compat/kernels/gemv/int4_one_row.py's dp4a kernel
# (`--parts int4_one_row`, H100, 2026-11-28, thirteenth session: q|k|v 8.7 us and gate|up 26.0 with their RMSNorms
# as their own kernels, o 5.8, down 16.7 split 14 ways; the fastest in the decode step too, against 8 other mixes);
# the 8-row entry is the tile kernel's (`--parts int4`, H100, 2026-11-24). The sweeps print these.
TUNED_INT4: dict[tuple[int, int, int, int], GemvConfig] = {
    (6144, 4096, PROLOGUE_RMSNORM, 1): GemvConfig(
        block_n=32, block_k=4096, num_stages=1, separate_prologue=True, one_row=True
    ),
    (4096, 4096, PROLOGUE_NONE, 1): GemvConfig(block_n=8, block_k=4096, num_stages=1, one_row=True),
    (28672, 4096, PROLOGUE_RMSNORM, 1): GemvConfig(
        block_n=8, block_k=4096, num_stages=1, separate_prologue=True, one_row=True
    ),
    (4096, 14336, PROLOGUE_SILU_MUL, 1): GemvConfig(
        block_n=32, block_k=1024, num_warps=1, num_stages=1, split_k=14, one_row=True
    ),
    (6144, 4096, PROLOGUE_RMSNORM, 8): GemvConfig(num_stages=1),
}


def int4_config(k: int, num_rows: int, group_size: int, n: int = 0, prologue: int = PROLOGUE_NONE) -> GemvConfig:
    """The tuned config of this shape (groups of 128), else the int4 kernels' rule of thumb.

    At one row: the one-row kernel (tgi_compat/kernels/gemv/int4_one_row.py), 16 rows a program (TUNED_INT4's run 8 to 32)
    over a K tile of 1,024 features a warp (4 warps at 4,096, fewer where that does not divide K), K split into
    such tiles past 4,096 (down's 14,336: 7 tiles of 2,048); the tile kernel where no such tile divides K. On an
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
                return GemvConfig(block_n=16, block_k=width, num_warps=width // 1024, num_stages=1,
                                  split_k=k // width if k > 4096 else 1, one_row=True)  # fmt: skip
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
    if isinstance(weight, torch.Tensor):  # (not isinstance QuantizedWeight: tests reload this module)
        return gemv_config(n, k, prologue) if x.shape[0] == 1 else None
    max_rows = MAX_ROW_SCALED_ROWS if weight.format == WEIGHT_ROW_SCALED else MAX_QUANTIZED_ROWS
    if weight.format == WEIGHT_INT4 and prologue == PROLOGUE_NORM_ADD_NORM:
        return None  # the int4 kernel has no such prologue
    if x.shape[0] > max_rows or (weight.format == WEIGHT_INT4 and not _is_power_of_2(weight.group_size)):
        return None
    return gemv_config(n, k, prologue, weight.format, x.shape[0], weight.group_size)


def _is_power_of_2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def few_rows_gemv(weight: QuantizedWeight | None, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The GEMV over a quantized weight when x is the few rows of decoding on CUDA (it reads 1 or 1/2 byte
    a weight where the GEMM paths are built for more rows); None: the caller takes its own path."""
    if weight is None:
        return None
    config = gemv_config_for(x, weight, PROLOGUE_NONE)
    return gemv(x, weight, bias, config=config) if config is not None else None


def gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul; M small (decode rows)
    weight: torch.Tensor | QuantizedWeight,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: apply RMSNorm (eps) to x first
    eps: float = 0.0,
    residual: torch.Tensor | None = None,  # [M, K]: normalise x + residual (RMSNorm only)
    residual_out: torch.Tensor | None = None,  # [M, K]: receives x + residual
    x_norm_weight: torch.Tensor | None = None,  # [K]: x is RMS-normed by it (x_eps) before the residual add
    x_eps: float = 0.0,
    silu_mul: bool = False,
    gelu_tanh: bool = False,  # with silu_mul: the gate's activation is tanh-approximated GELU (GeGLU)
    config: GemvConfig | None = None,
    push: PushTarget | None = None,  # send the output to the other ranks as it is stored (not int4)
) -> torch.Tensor:
    """Returns [M, N] in x's dtype. With `push`, the caller finishes the sum over the ranks with
    tgi_compat.kernels.comm.one_shot_all_reduce.one_shot_all_reduce_(out, ..., sent=True)."""
    n, k = weight.shape
    m = x.shape[0]
    assert x.stride(-1) == 1 and x.shape[1] == (2 * k if silu_mul else k), (tuple(x.shape), (n, k))
    assert not (silu_mul and norm_weight is not None)
    prologue = PROLOGUE_SILU_MUL if silu_mul else PROLOGUE_RMSNORM if norm_weight is not None else PROLOGUE_NONE
    if gelu_tanh:
        assert silu_mul, "gelu_tanh selects the gated prologue's activation"
        prologue = PROLOGUE_GELU_TANH_MUL
    if x_norm_weight is not None:
        assert prologue == PROLOGUE_RMSNORM and residual is not None, "x's norm goes before a residual add and a norm"
        prologue = PROLOGUE_NORM_ADD_NORM
    if residual is not None:
        assert prologue in (PROLOGUE_RMSNORM, PROLOGUE_NORM_ADD_NORM) and residual_out is not None
        assert residual.is_contiguous() and residual_out.is_contiguous() and residual.shape == (m, k)
        assert residual_out.data_ptr() != residual.data_ptr(), "program 0 writes residual_out while others read"
    if config is None and not isinstance(weight, torch.Tensor) and weight.format == WEIGHT_INT4:
        config = int4_config(k, m, weight.group_size, n, prologue)
    if config is not None and config.separate_prologue and prologue != PROLOGUE_NONE:
        if silu_mul:
            x = silu_mul_module.silu_mul(x, gelu_tanh=gelu_tanh)
        elif prologue == PROLOGUE_NORM_ADD_NORM:
            assert norm_weight is not None and x_norm_weight is not None and residual is not None
            x = rmsnorm_module.norm_add_rmsnorm(
                x, x_norm_weight, x_eps, residual, norm_weight, eps, residual_out=residual_out
            )
        else:
            assert norm_weight is not None
            x = rmsnorm_module.rmsnorm(x, norm_weight, eps, residual=residual, residual_out=residual_out)
        return gemv(x, weight, bias, config=dataclasses.replace(config, separate_prologue=False), push=push)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dummy = x
    pdl = use_pdl(x)
    common = (
        x,
        residual if residual is not None else dummy,
        residual_out if residual_out is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
    )
    if not isinstance(weight, torch.Tensor) and weight.format == WEIGHT_INT4:
        assert prologue != PROLOGUE_NORM_ADD_NORM, "the int4 kernel has no NORM_ADD_NORM prologue"
        assert push is None, "the int4 kernels do not push"
        _launch_int4(common, weight, bias, out, eps, prologue, residual is not None, config, pdl)
        return out
    if isinstance(weight, torch.Tensor):
        data, scale, stride_sn = weight, None, 0
    else:
        data, scale = weight.data, weight.scale.reshape(-1)
        stride_sn = scale.stride(0) if scale.numel() > 1 else 0
    assert data.stride(1) == 1
    weight_format = WEIGHT_DENSE if scale is None else WEIGHT_ROW_SCALED
    config = config or gemv_config(n, k, prologue, weight_format, m) or GemvConfig()
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        *common,
        x_norm_weight if x_norm_weight is not None else dummy,
        data,
        scale if scale is not None else dummy,
        bias if bias is not None else dummy,
        out,
        m,
        n,
        k,
        x.stride(0),
        data.stride(0),
        stride_sn,
        out.stride(0),
        eps,
        x_eps,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        ROW_SCALED=scale is not None,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PREFETCH=config.prefetch,
        USE_PDL=pdl,
        X_BLOCK=_x_block(k, m) if prologue == PROLOGUE_NORM_ADD_NORM else 16,
        **push_kernel_args(push, dummy),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out


def _x_block(k: int, num_rows: int) -> int:
    """NORM_ADD_NORM's 1/rms pass: the whole row in one load up to 8,192 features (32 fp32 values a thread of
    4 warps at one row), fewer features for more rows so that the tile stays as many registers."""
    return min(triton.next_power_of_2(k), max(256, 8192 // triton.next_power_of_2(num_rows)))


def _launch_int4(
    common: tuple,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
    prologue: int,
    has_residual: bool,
    config: GemvConfig | None,
    pdl: bool,
) -> None:
    x = common[0]
    (m, n), k = out.shape, weight.shape[1]
    group_size, period = weight.group_size, int4_period(weight.group_size)
    assert weight.zero is not None and weight.zero.stride() == weight.scale.stride() and k % group_size == 0
    assert _is_power_of_2(group_size) and weight.data.stride(1) == 1, group_size
    config = config or int4_config(k, m, group_size, n, prologue)
    if config.one_row and m == 1:
        from tgi_compat.kernels.gemv.int4_one_row import launch_int4_one_row  # (it imports this module's helpers)

        launch_int4_one_row(common, weight, bias, out, eps, prologue, has_residual, config, pdl)
        return
    block_k, split_k = int4_launch_tiles(k, group_size, config)
    block_m, programs = triton.next_power_of_2(m), triton.cdiv(n, config.block_n)
    partial, counters = split_k_scratch(x, programs, split_k, block_m * (config.block_n + 1))
    _gemv_int4_kernel[(programs, split_k)](
        *common,
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
        GROUP_SIZE=group_size,
        PERIOD=period,
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


_MAX_SPLIT_K_COLUMNS = 1 << 17
_split_k_counters: dict[torch.device, torch.Tensor] = {}


def split_k_scratch(
    x: torch.Tensor, programs: int, split_k: int, floats_a_program: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K launch's fp32 partial sums and its column counters (x stands in for both at split_k 1)."""
    if split_k == 1:
        return x, x
    partial = torch.empty(programs * split_k * floats_a_program, dtype=torch.float32, device=x.device)
    return partial, split_k_counters(x.device, programs)


def split_k_counters(device: torch.device, columns: int) -> torch.Tensor:
    """The device's split-K counters (int32, zero between launches: the last program of a column resets its
    counter). One buffer for the device's life, never reallocated, as CUDA graphs keep its address; the
    kernels using it run one at a time on the device's stream (each waits for the one before, PDL included)."""
    assert columns <= _MAX_SPLIT_K_COLUMNS, f"{columns} programs along N: raise block_n"
    counters = _split_k_counters.get(device)
    if counters is None:
        counters = _split_k_counters[device] = torch.zeros(_MAX_SPLIT_K_COLUMNS, dtype=torch.int32, device=device)
    return counters


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    gelu_tanh: bool = False,
    x_norm_weight: torch.Tensor | None = None,
    x_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, x + residual or None) with the unfused kernels' roundings, product in fp32 with the dequantized weight;
    with x_norm_weight, x is rmsnorm(x, x_norm_weight) first."""
    from tgi_compat.kernels.elementwise.rmsnorm import rmsnorm_ref
    from tgi_compat.kernels.elementwise.silu_mul import gelu_tanh_mul_ref, silu_mul_ref

    summed = None
    if silu_mul:
        x = gelu_tanh_mul_ref(x) if gelu_tanh else silu_mul_ref(x)
    elif norm_weight is not None:
        if x_norm_weight is not None:
            x = rmsnorm_ref(x, x_norm_weight, x_eps)
        if residual is not None:
            summed = (x.float() + residual.float()).to(x.dtype)
        x = rmsnorm_ref(summed if summed is not None else x, norm_weight, eps)
    w = weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()
    y = x.float() @ w.T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype), summed
