"""The pieces the LoRA kernels share (shrink and expand): a slot's block of rows from the segment table, a tile
of the shrink's input through its prologue, and the add into the base output."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def segment_rows(order_ptr, seg_start_ptr, slot, offs_m, num_tokens):
    """(mask, rows in token_order, token indices) of a block of the slot's segment; offs_m: offsets into it."""
    mask_m = offs_m < num_tokens
    rows = tl.load(seg_start_ptr + slot) + offs_m
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
