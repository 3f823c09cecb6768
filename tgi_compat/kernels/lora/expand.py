"""LoRA expand: each token's shrunk row times its slot's B, added into the base output, every slice of a fused
projection (q|k|v, gate|up) in one launch: slice s owns the output columns [ends[s-1], ends[s]) and the rank
block s*R .. (s+1)*R of the shrunk row, whose split-K partial sums (tgi_compat.kernels.lora.shrink) it adds up as it
reads them, and scales by a norm prologue's 1 / rms from the splits' sums of squares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.lora.segments import LoraSegments
from tgi_compat.kernels.lora.shrink import Shrunk
from tgi_compat.kernels.lora.tiles import add_into, block_rows, segment_block, segment_blocks, table_block
from tgi_compat.kernels.pdl import launch_options, use_pdl

# output columns per program, each of which reads its rows' split-K partial sums again: 128 beat 64 and 256 at 1, 8
# and 64 rows (a decode step's kernels 10-15% faster, H100, benchmarks/device/lora_step.py, 2026-12-06)
EXPAND_BLOCK_N = 128


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr,  # [P, T, S * R] float32, rows in sorted order: P partial sums
    sum_sq_ptr,  # [P, T] float32 (NORM): the splits' sums of squares of the norm's input
    b_ptr,  # [L, OUT, R]: every slot's B, all slices' output columns stacked
    order_ptr,  # [T] int64
    seg_start_ptr,  # [L] int64
    seg_len_ptr,  # [L] int64
    out_ptr,  # [T, OUT], added into
    T,
    L,
    end0,  # slice 0's last output column + 1
    end1,  # slice 1's (fused projections of 2 or 3 parts)
    end2,  # slice 2's
    out_size,  # the last slice's end: the columns written
    R,  # max rank
    num_parts,  # P
    norm_cols,  # (NORM) the norm's columns
    eps,
    stride_s_part,
    stride_s,
    stride_q_part,
    stride_b_slot,
    stride_b_row,
    stride_o,
    NUM_SLICES: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_L: tl.constexpr,  # segment_block's table width
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the shrink (Hopper)
):
    slot, first, left = segment_block(seg_start_ptr, seg_len_ptr, L, T, BLOCK_M, BLOCK_L, False)
    if slot >= 0:  # programs past the last block stop here
        mask_m, rows, tokens = block_rows(order_ptr, first, left, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < out_size
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_b_slot + offs_n[None, :] * stride_b_row + offs_r[:, None],
            mask=mask_n[None, :] & mask_r[:, None],
            other=0.0,
        ).to(tl.float32)
        # each column's slice: how many slice ends lie at or before it
        column_slice = (offs_n >= end0).to(tl.int32)
        if NUM_SLICES > 2:
            column_slice += (offs_n >= end1).to(tl.int32)
        if USE_PDL:  # B is read above, before the shrink has finished; its sums and out below, after
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the next projection may start reading its weights
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        shrunk_ptrs = shrunk_ptr + rows[:, None] * stride_s + offs_r[None, :]
        mask_s = mask_m[:, None] & mask_r[None, :]
        for s in tl.static_range(NUM_SLICES):
            shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            # a loop, not unrolled: unrolled (session 26) the expand went from 1,345 to 1,840 us a step at 64 rows,
            # and turning PDL off did not bring it back (session 27); this loop's time is session 25's, not re-measured
            for part in range(num_parts):
                shrunk += tl.load(shrunk_ptrs + part * stride_s_part + s * R, mask=mask_s, other=0.0)
            delta += tl.where(column_slice[None, :] == s, tl.dot(shrunk, b), 0.0)  # [BLOCK_M, BLOCK_N]
        if NORM:  # the norm's 1 / rms(x), a factor of the whole row
            sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for part in range(num_parts):
                sum_sq += tl.load(sum_sq_ptr + part * stride_q_part + rows, mask=mask_m, other=0.0)
            delta *= tl.rsqrt(sum_sq / norm_cols + eps)[:, None]
        add_into(out_ptr, tokens, offs_n, mask_m, mask_n, stride_o, delta)


def lora_expand(
    out: torch.Tensor,
    shrunk: Shrunk,
    b: torch.Tensor,
    step: LoraSegments,
    slice_ends: tuple[int, ...],
    block_n: int = EXPAND_BLOCK_N,
    pdl: bool | None = None,  # None: on Hopper (tgi_compat.kernels.pdl)
) -> None:
    """out[token, slice s's columns] += shrunk.rows()[i, s * R : (s + 1) * R] @ B[slot, those columns]^T for each
    LoRA token (b [L, OUT, R]; slice s's columns end at slice_ends[s], the last at OUT); others are left alone."""
    num_slots, _, rank = b.shape
    assert 1 <= len(slice_ends) <= 3 and slice_ends[-1] <= out.shape[1], slice_ends
    ends = (*slice_ends, *[slice_ends[-1]] * (3 - len(slice_ends)))
    block_m = 16
    grid = (segment_blocks(out.shape[0], num_slots, block_m), triton.cdiv(slice_ends[-1], block_n))
    partials, sum_sq = shrunk.partials, shrunk.sum_sq
    pdl = use_pdl(out) if pdl is None else pdl
    _lora_expand_kernel[grid](
        partials, partials if sum_sq is None else sum_sq, b, step.token_order, step.seg_start, step.seg_len, out,
        out.shape[0], num_slots, *ends, slice_ends[-1], rank, partials.shape[0], shrunk.norm_cols, shrunk.eps,
        partials.stride(0), partials.stride(1), 0 if sum_sq is None else sum_sq.stride(0), b.stride(0), b.stride(1),
        out.stride(0),
        NUM_SLICES=len(slice_ends), NORM=sum_sq is not None, BLOCK_M=block_m, BLOCK_L=table_block(num_slots),
        BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)), USE_PDL=pdl,
        **launch_options(pdl),
    )  # fmt: skip


def lora_expand_ref(
    out: torch.Tensor, shrunk: Shrunk, b: torch.Tensor, step: LoraSegments, slice_ends: tuple[int, ...]
) -> None:
    """The definition, one matmul per live segment and slice (also the CPU path)."""
    rank, rows = b.shape[2], shrunk.rows()
    for slot, (start, length) in enumerate(zip(step.seg_start.tolist(), step.seg_len.tolist())):
        if not length:
            continue
        tokens = step.token_order[start : start + length]
        for index, (begin, end) in enumerate(zip((0, *slice_ends[:-1]), slice_ends)):
            shrunk_part = rows[start : start + length, index * rank : (index + 1) * rank]
            out[tokens, begin:end] += (shrunk_part @ b[slot, begin:end].float().T).to(out.dtype)
