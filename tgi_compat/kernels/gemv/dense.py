"""The GEMV over [BLOCK_N, BLOCK_K] tiles of a dense (fp16/bf16/fp32) or row-scaled 1-byte (int8, FP8) weight.

Each program owns BLOCK_N output rows and walks the whole K once, so there is no split-K reduction; the prologue
is recomputed per program from L2 (K elements per row of x, against BLOCK_N * K weight elements from HBM). A
one-row variant for 1-byte weights with [BLOCK_N, BLOCK_K/16, 16] tiles was swept against it on an H100 and lost
in every pair that mattered, so it is gone.

An int8 weight becomes a float without a conversion instruction (a quarter-rate pipe that would bound the kernel):
OR-ing a value 0 <= v < 2^23 into the mantissa of 2^23 gives the float 2^23 + v, and subtracting 2^23 (plus the
+128 bias) is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.comm.one_shot_all_reduce import PushTarget, push_kernel_args, push_to_peers
from tgi_compat.kernels.gemv.config import gemv_config
from tgi_compat.kernels.gemv.epilogue import store_output
from tgi_compat.kernels.gemv.prologue import (
    activation_block,
    inv_rms_rows,
    store_normed_residual_sum,
    store_residual_sum,
)
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_NORM_ADD_NORM,
    WEIGHT_DENSE,
    WEIGHT_ROW_SCALED,
    Activations,
    GemvConfig,
    QuantizedWeight,
)
from tgi_compat.kernels.pdl import launch_options


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
    w,
    offs_k,
    x_rows,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """acc += w * f(x) over one K block (`w`: its stored tile, already loaded); sum_sq += f(x)'s squares (RMSNORM)."""
    xk, squares = activation_block(x_rows, offs_k, PROLOGUE, HAS_RESIDUAL, EVEN_K)
    if w.dtype == tl.int8:
        wf = _int8_to_float(w)
    else:
        wf = w.to(tl.float32)
    acc = _fma_rows(acc, wf, xk, BLOCK_M)
    if PROLOGUE == 1 or PROLOGUE == 4:
        sum_sq += squares
    return acc, sum_sq


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
        x_inv_rms = inv_rms_rows(x_ptr, rows_m, mask_m, stride_xm, K, x_eps, X_BLOCK)
        if pid == 0:
            store_normed_residual_sum(
                x_ptr, x_norm_weight_ptr, x_inv_rms, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K
            )
    elif HAS_RESIDUAL:
        if pid == 0:
            store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K)
    x_rows = (x_ptr, residual_ptr, norm_weight_ptr, x_norm_weight_ptr, x_inv_rms, rows_m, mask_m, stride_xm, K)
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
                acc, sum_sq, w, k0 + offs_c, x_rows, PROLOGUE, HAS_RESIDUAL, EVEN_K, BLOCK_M
            )
            w = w_next
    else:
        acc, sum_sq = _accumulate_block(acc, sum_sq, w, offs_c, x_rows, PROLOGUE, HAS_RESIDUAL, EVEN_K, BLOCK_M)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w = _weight_tile(w_ptr, rows, stride_wn, k0 + offs_c, K, EVEN_K)
            acc, sum_sq = _accumulate_block(
                acc, sum_sq, w, k0 + offs_c, x_rows, PROLOGUE, HAS_RESIDUAL, EVEN_K, BLOCK_M
            )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own weight reads

    if BLOCK_M == 1:
        y = tl.sum(acc, 1)[None, :]
    else:
        y = tl.sum(acc, 2)  # [BLOCK_M, BLOCK_N]
    out_tile = (out_ptr, offs_m, mask_m, offs_n, mask_n, stride_om)
    stored = store_output(
        y, tl.sum(sum_sq, 1), out_tile, rows, scale_ptr, stride_sn, bias_ptr, K, eps, PROLOGUE, ROW_SCALED, HAS_BIAS
    )
    if PUSH:  # out is [M, N] contiguous: element (m, n) is the all-reduce's m * N + n
        flat = offs_m[:, None] * N + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        target = (push_buffer_ptrs, push_halves_ptr, push_capacity)
        push_to_peers(stored, flat, mask, target, PUSH_RANK, PUSH_WORLD, PUSH_BLOCK, SENTINEL)


def launch_dense(
    acts: Activations,
    x_norm_weight: torch.Tensor | None,
    weight: torch.Tensor | QuantizedWeight,  # dense, or row-scaled 1-byte
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, N]
    eps: float,
    x_eps: float,
    prologue: int,
    has_residual: bool,
    config: GemvConfig | None,
    pdl: bool,
    push: PushTarget | None,
) -> None:
    """`_gemv_kernel` over BLOCK_N output rows a program (config: the shape's own where None)."""
    x = acts.x  # stands in for every absent tensor: never read
    (m, n), k = out.shape, weight.shape[1]
    if isinstance(weight, torch.Tensor):
        data, scale, stride_sn = weight, None, 0
    else:
        data, scale = weight.data, weight.scale.reshape(-1)
        stride_sn = scale.stride(0) if scale.numel() > 1 else 0
    assert data.stride(1) == 1
    weight_format = WEIGHT_DENSE if scale is None else WEIGHT_ROW_SCALED
    config = config or gemv_config(n, k, prologue, weight_format, m) or GemvConfig()
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        *acts,
        x_norm_weight if x_norm_weight is not None else x,
        data,
        scale if scale is not None else x,
        bias if bias is not None else x,
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
        HAS_RESIDUAL=has_residual,
        HAS_BIAS=bias is not None,
        ROW_SCALED=scale is not None,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PREFETCH=config.prefetch,
        USE_PDL=pdl,
        X_BLOCK=_x_block(k, m) if prologue == PROLOGUE_NORM_ADD_NORM else 16,
        **push_kernel_args(push, x),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )


def _x_block(k: int, num_rows: int) -> int:
    """NORM_ADD_NORM's 1/rms pass: the whole row in one load up to 8,192 features (32 fp32 values a thread of
    4 warps at one row), fewer features for more rows so that the tile stays as many registers."""
    return min(triton.next_power_of_2(k), max(256, 8192 // triton.next_power_of_2(num_rows)))
