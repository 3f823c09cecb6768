"""The pieces the LoRA kernels share (shrink and expand): a program's block of rows from the segment table, a tile
of the shrink's input through its prologue, and the add into the base output.

A launch numbers the blocks of every segment one after another (`segment_block`) rather than giving each slot a
whole row of blocks as if it held every token: at 64 rows over 8 slots that was 36 programs a column tile where 8
work, at a 4096-token prefill 2,048 where 256 do."""

from __future__ import annotations

import triton
import triton.language as tl


def segment_blocks(num_tokens: int, num_segments: int, block_m: int) -> int:
    """Programs along M that cover the blocks of any split of num_tokens into num_segments segments (each
    segment's last block may be short: at most one block more a segment than the tokens fill)."""
    return triton.cdiv(num_tokens, block_m) + num_segments


def table_block(num_segments: int) -> int:
    """segment_block's BLOCK_L: the segment table's entries (the base rows' too, where they are one), a power of two."""
    return max(2, triton.next_power_of_2(num_segments))


@triton.jit
def segment_block(
    seg_start_ptr,
    seg_len_ptr,
    num_slots,
    num_tokens,
    BLOCK_M: tl.constexpr,
    BLOCK_L: tl.constexpr,
    WITH_BASE: tl.constexpr,
):
    """Program_id(0)'s block: the slots' segments in slot order, then (WITH_BASE) the base rows after the last
    slot's, cut into BLOCK_M-row blocks numbered one after another. Returns its segment (the slot; num_slots for the
    base rows; -1 past the last block), its first row in token_order and the rows its segment has from there.
    The whole table in one load (table_block): a loop of loads put their latencies in series, in every
    program (the folded expand took 14% longer a step at 64 rows, H100)."""
    pid = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK_L)
    is_slot = index < num_slots
    starts = tl.load(seg_start_ptr + index, mask=is_slot, other=0)
    lengths = tl.load(seg_len_ptr + index, mask=is_slot, other=0)
    if WITH_BASE:  # the rows past the last slot's segment, as segment num_slots
        base_start = tl.sum(tl.where(index == num_slots - 1, starts + lengths, 0))
        is_base = index == num_slots
        starts = tl.where(is_base, base_start, starts)
        lengths = tl.where(is_base, num_tokens - base_start, lengths)
    blocks = (lengths + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)  # the block after each segment's last
    inside = (pid >= ends - blocks) & (pid < ends)
    offset = (pid - (ends - blocks)) * BLOCK_M
    segment = tl.max(tl.where(inside, index, -1), 0)
    first = tl.sum(tl.where(inside, starts + offset, 0))
    left = tl.sum(tl.where(inside, lengths - offset, 0))
    return segment, first, left


@triton.jit
def block_rows(order_ptr, first, left, BLOCK_M: tl.constexpr):
    """(mask, rows in token_order, token indices) of a block from `first` with `left` rows of its segment."""
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < left
    rows = first + offs_m
    tokens = tl.load(order_ptr + rows, mask=mask_m, other=0)
    return mask_m, rows, tokens


@triton.jit
def prologue_tile(x_rows, offs_k, mask_m, K, SILU_MUL: tl.constexpr):
    """[BLOCK_M, BLOCK_K] float32 of the shrink's input at columns offs_k: x, or silu(gate) * up of x = [gate | up]
    (a norm's weight and 1 / rms are the shrink's and the expand's)."""
    mask_x = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(x_rows + K + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x


@triton.jit
def add_into(out_ptr, tokens, offs_n, mask_m, mask_n, stride_o, delta):
    """out[tokens, offs_n] += delta, in out's dtype (each token sits in one segment: no other program touches
    its row's columns)."""
    out_ptrs = out_ptr + tokens[:, None] * stride_o + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)
