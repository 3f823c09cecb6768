"""LoRA shrink and expand in one launch, for steps of few rows (decode at small batch): at batch 1 a projection's
two launches cost ~3 us each even replayed from a CUDA graph, against a ~4 us budget per projection (issue 39).

Program (n, slot) takes the slot's rows (at most FUSED_MAX_ROWS, so one block of them) and output columns
[n * BLOCK_N, (n + 1) * BLOCK_N): it computes prologue(x) @ A[slot, slice s]^T for each slice s of a fused
projection (q|k|v, gate|up) whose columns the tile meets (float32 sums of bf16 products, as the shrink), then adds
that times B[slot, its columns] into out in place (B holds the adapter's scaling, tgi_compat.modeling.lora.adapter).
Each tile recomputes its slice's shrink, a few hundred KB of A read from L2: cheaper at these sizes than a second
launch. Idle slots' programs stop at once; the grid depends on the row count and --max-loras only, so a captured
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
        n_start = tl.program_id(0) * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < out_size
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_b_slot + offs_n[None, :] * stride_b_row + offs_r[:, None],
            mask=mask_n[None, :] & mask_r[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_R, BLOCK_N]: shared by the slices, each owns its columns
        inv_rms = tl.full((_BLOCK_M,), 1.0, dtype=tl.float32)
        if NORM:
            inv_rms = row_inv_rms(x_rows, mask_m, K, eps, _BLOCK_M, _BLOCK_K)
        column_slice = (offs_n >= end0).to(tl.int32)
        if NUM_SLICES > 2:
            column_slice += (offs_n >= end1).to(tl.int32)
        first_slice = tl.min(tl.where(mask_n, column_slice, NUM_SLICES), axis=0)
        last_slice = tl.max(tl.where(mask_n, column_slice, -1), axis=0)
        delta = tl.zeros((_BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(NUM_SLICES):
            if (first_slice <= s) & (s <= last_slice):  # only the slices this tile's columns belong to
                shrunk = tl.zeros((_BLOCK_M, BLOCK_R), dtype=tl.float32)
                a_rows = a_base + (s * R + offs_r)[None, :] * stride_a_row
                for k in range(0, K, _BLOCK_K):
                    offs_k = k + tl.arange(0, _BLOCK_K)
                    x = prologue_tile(x_rows, norm_ptr, offs_k, mask_m, K, NORM, SILU_MUL)
                    a = tl.load(a_rows + offs_k[:, None], mask=mask_r[None, :] & (offs_k < K)[:, None], other=0.0)
                    shrunk += tl.dot(x.to(a.dtype), a)  # [rows, BLOCK_R]
                shrunk *= inv_rms[:, None]
                delta += tl.where(column_slice[None, :] == s, tl.dot(shrunk, b), 0.0)
        add_into(out_ptr, tokens, offs_n, mask_m, mask_n, stride_o, delta)


def fused_block_n(num_rows: int, num_slots: int, out_size: int) -> int:
    """Output columns per program: ~128 programs in all when every row is on its own slot (1 row: 96 for q|k|v's
    6144 columns, 112 for gate|up's 28672), so A's slice is read by enough SMs and not too many times over."""
    live_slots = max(1, min(num_rows, num_slots))
    tiles = max(8, 128 // live_slots)
    return min(256, max(32, triton.next_power_of_2(triton.cdiv(out_size, tiles))))


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One projection's slot buffers, as tgi_compat.modeling.lora.weights holds them."""

    a: torch.Tensor  # [L, S * R, K]: every slot's stacked A
    b: torch.Tensor  # [L, OUT, R]: every slot's B (the scaling folded in)
    slice_ends: tuple[int, ...]  # each slice's last output column + 1


def lora_fused(
    out: torch.Tensor, x: torch.Tensor, pair: LoraPair, step: LoraSegments, prologue: ShrinkPrologue = NO_PROLOGUE
) -> None:
    """out[token, slice s's columns] += prologue(x[token]) @ A[slot, slice s]^T @ B[slot, those columns]^T for each
    LoRA token of a step of at most FUSED_MAX_ROWS rows (x [T, K], or [T, 2K] with SiLU-and-mul); others are left
    alone. One launch."""
    (a, b, slice_ends), num_tokens = (pair.a, pair.b, pair.slice_ends), x.shape[0]
    (num_slots, _, k), rank = a.shape, b.shape[2]
    assert num_tokens <= FUSED_MAX_ROWS, num_tokens
    assert x.shape[1] == (2 * k if prologue.silu_mul else k), (x.shape, a.shape)
    assert 1 <= len(slice_ends) <= 3 and slice_ends[-1] <= out.shape[1], slice_ends
    block_n = fused_block_n(num_tokens, num_slots, slice_ends[-1])
    grid = (triton.cdiv(slice_ends[-1], block_n), num_slots)
    norm_weight = prologue.norm_weight
    _lora_fused_kernel[grid](
        norm_weight is not None,
        prologue.silu_mul,
        len(slice_ends),
        block_n,
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
