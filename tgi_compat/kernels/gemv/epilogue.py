"""The GEMV's epilogue: the split-K reduction of the int4 kernels and the output's scales, bias and store.

The output tile travels as one tuple, `out_tile` = (out_ptr, offs_m, mask_m, offs_n, mask_n, stride_om) (see
tgi_compat/kernels/gemv/prologue.py on tuples).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_output(
    y,  # [BLOCK_M, BLOCK_N] fp32, before the 1/rms and per-channel scales
    sum_sq,  # [BLOCK_M] sums of squares of the normed rows (RMSNORM)
    out_tile,
    rows,  # [BLOCK_N] int64: the output channels, clamped in range
    scale_ptr,
    stride_sn,
    bias_ptr,
    K,
    eps,
    PROLOGUE: tl.constexpr,
    ROW_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    out_ptr, offs_m, mask_m, offs_n, mask_n, stride_om = out_tile
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
def reduce_split_k(
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
