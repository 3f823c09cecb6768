"""LoRA shrink and expand in one launch, for steps of few rows (decode at small batch): at batch 1 a projection's
two launches cost ~3 us each even replayed from a CUDA graph, against a ~4 us budget per projection (issue 39).

Program (n, slot) takes the slot's rows (at most FUSED_MAX_ROWS, so one block of them) and a span of output
columns: for each slice s of a fused projection (q|k|v, gate|up) the span meets it computes prologue(x) @
A[slot, slice s]^T (float32 sums of bf16 products, as the shrink), then, tile by tile of the span's columns of
that slice, adds that times B[slot, those columns] into out in place (B holds the adapter's scaling,
tgi_compat.modeling.lora.adapter). Each span recomputes its slices' shrink, A's slice read again from L2: cheaper
at these sizes than a second launch, within a budget of such reads (fused_spans). Idle slots' programs stop at once; the grid depends on the row count and --max-loras only, so a captured
CUDA graph replays any mix of adapters. The definition is the shrink then the expand (their torch references).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.lora.expand import lora_expand_ref
from tgi_compat.kernels.lora.segments import LoraSegments
from tgi_compat.kernels.lora.shrink import NO_PROLOGUE, ShrinkPrologue, lora_shrink_ref
from tgi_compat.kernels.lora.tiles import add_into, prologue_tile, row_inv_rms, segment_rows

FUSED_MAX_ROWS = 16  # steps of at most this many rows take the fused kernel (one row block per slot)


# the row block (a step's rows of one slot, all of them) and the K block: fixed
_BLOCK_M = tl.constexpr(FUSED_MAX_ROWS)
_BLOCK_K = tl.constexpr(128)


@triton.jit
def _lora_fused_kernel(
    # compile-time first
    NORM: tl.constexpr,  # the prologue: x's RMS norm (norm_ptr's weight, eps), or
    SILU_MUL: tl.constexpr,  # SiLU-and-mul of x = [gate | up]
    NUM_SLICES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    x_ptr,  # [T, K] ([T, 2K]: gate | up with SILU_MUL)
    a_ptr,  # [L, S * R, K]: every slot's stacked A
    b_ptr,  # [L, OUT, R]: every slot's B, all slices' output columns stacked
    norm_ptr,  # [K]: the RMS norm's weight (NORM)
    order_ptr,  # [T] int64: token indices sorted by slot
    seg_start_ptr,  # [L] int64
    seg_len_ptr,  # [L] int64
    out_ptr,  # [T, OUT], added into
    K,
    R,  # max rank
    end0,  # slice 0's last output column + 1
    end1,  # slice 1's (fused projections of 3 parts)
    out_size,  # the last slice's end: the columns written
    span_cols,  # each program's columns (its span), in tiles of BLOCK_N
    eps,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_b_slot,
    stride_b_row,
    stride_o,
):
    num_tokens = tl.load(seg_len_ptr + tl.program_id(1))  # 0 for an idle slot: its programs stop at once
    if num_tokens > 0:
        slot = tl.program_id(1)
        mask_m, _, tokens = segment_rows(order_ptr, seg_start_ptr, slot, tl.arange(0, _BLOCK_M), num_tokens)
        x_rows = x_ptr + tokens[:, None] * stride_x
        span_start = tl.program_id(0) * span_cols
        span_end = tl.minimum(span_start + span_cols, out_size)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
        b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
        inv_rms = tl.full((_BLOCK_M,), 1.0, dtype=tl.float32)
        if NORM:
            inv_rms = row_inv_rms(x_rows, mask_m, K, eps, _BLOCK_M, _BLOCK_K)
        for s in tl.static_range(NUM_SLICES):
            # slice s's columns within this program's span (end1 = out_size for 2 slices, end0 for 1)
            if s == 0:
                lo = span_start
                hi = tl.minimum(span_end, end0)
            elif s == 1:
                lo = tl.maximum(span_start, end0)
                hi = tl.minimum(span_end, end1)
            else:
                lo = tl.maximum(span_start, end1)
                hi = span_end
            if lo < hi:  # the span meets the slice: its shrink once, then each tile of its columns
                shrunk = tl.zeros((_BLOCK_M, BLOCK_R), dtype=tl.float32)
                a_rows = a_base + (s * R + offs_r)[None, :] * stride_a_row
                for k in range(0, K, _BLOCK_K):
                    offs_k = k + tl.arange(0, _BLOCK_K)
                    x = prologue_tile(x_rows, norm_ptr, offs_k, mask_m, K, NORM, SILU_MUL)
                    a = tl.load(a_rows + offs_k[:, None], mask=mask_r[None, :] & (offs_k < K)[:, None], other=0.0)
                    shrunk += tl.dot(x.to(a.dtype), a)  # [rows, BLOCK_R]
                shrunk *= inv_rms[:, None]
                for n in range(span_start + (lo - span_start) // BLOCK_N * BLOCK_N, hi, BLOCK_N):
                    offs_n = n + tl.arange(0, BLOCK_N)
                    mask_n = (offs_n >= lo) & (offs_n < hi)  # each column written by its slice's pass only
                    b = tl.load(
                        b_base + offs_n[None, :] * stride_b_row + offs_r[:, None],
                        mask=mask_n[None, :] & mask_r[:, None],
                        other=0.0,
                    ).to(tl.float32)
                    add_into(out_ptr, tokens, offs_n, mask_m, mask_n, stride_o, tl.dot(shrunk, b))


# Each program's shrink reads its slice of A (R x K) from L2; the spans per slot keep the reads of all programs
# near this (1 row, bf16 r = 16: 32 spans for K = 4096, 9 for down's 14336, whose A slice alone takes one SM ~4 us)
A_READ_BUDGET = 4 << 20


def fused_spans(num_rows: int, num_slots: int, slice_bytes: int, out_size: int) -> int:
    """Programs per slot along the output columns: A_READ_BUDGET over the live slots' slice reads, at least one
    and at most one per 32 columns."""
    live_slots = max(1, min(num_rows, num_slots))
    return max(1, min(A_READ_BUDGET // (live_slots * slice_bytes), triton.cdiv(out_size, 32)))


def fused_block_n(span_cols: int) -> int:
    """Columns per tile of a span (its B tile and output tile in registers): up to 128."""
    return min(128, max(16, triton.next_power_of_2(span_cols)))


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One projection's slot buffers, as tgi_compat.modeling.lora.weights holds them."""

    a: torch.Tensor  # [L, S * R, K]: every slot's stacked A
    b: torch.Tensor  # [L, OUT, R]: every slot's B (the scaling folded in)
    slice_ends: tuple[int, ...]  # each slice's last output column + 1


def lora_fused(
    out: torch.Tensor,
    x: torch.Tensor,
    pair: LoraPair,
    step: LoraSegments,
    prologue: ShrinkPrologue = NO_PROLOGUE,
    spans: int | None = None,
) -> None:
    """out[token, slice s's columns] += prologue(x[token]) @ A[slot, slice s]^T @ B[slot, those columns]^T for each
    LoRA token of a step of at most FUSED_MAX_ROWS rows (x [T, K], or [T, 2K] with SiLU-and-mul); others are left
    alone. One launch; spans: programs per slot along the columns (default fused_spans; the benchmark sweeps it)."""
    (a, b, slice_ends), num_tokens = (pair.a, pair.b, pair.slice_ends), x.shape[0]
    (num_slots, _, k), rank = a.shape, b.shape[2]
    assert num_tokens <= FUSED_MAX_ROWS, num_tokens
    assert x.shape[1] == (2 * k if prologue.silu_mul else k), (x.shape, a.shape)
    assert 1 <= len(slice_ends) <= 3 and slice_ends[-1] <= out.shape[1], slice_ends
    spans = spans or fused_spans(num_tokens, num_slots, rank * k * a.element_size(), slice_ends[-1])
    span_cols = triton.cdiv(slice_ends[-1], spans)
    grid = (triton.cdiv(slice_ends[-1], span_cols), num_slots)
    norm_weight = prologue.norm_weight
    _lora_fused_kernel[grid](
        norm_weight is not None,
        prologue.silu_mul,
        len(slice_ends),
        fused_block_n(span_cols),
        max(16, triton.next_power_of_2(rank)),
        x,
        a,
        b,
        x if norm_weight is None else norm_weight,
        step.token_order,
        step.seg_start,
        step.seg_len,
        out,
        k,
        rank,
        slice_ends[0],
        slice_ends[min(1, len(slice_ends) - 1)],
        slice_ends[-1],
        span_cols,
        prologue.eps,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
    )


def lora_fused_ref(
    out: torch.Tensor, x: torch.Tensor, pair: LoraPair, step: LoraSegments, prologue: ShrinkPrologue = NO_PROLOGUE
) -> None:
    """The definition: the shrink's then the expand's."""
    lora_expand_ref(out, lora_shrink_ref(x, pair.a, step, prologue), pair.b, step, pair.slice_ends)
