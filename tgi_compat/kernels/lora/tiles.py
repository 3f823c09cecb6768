"""The pieces the LoRA kernels share (shrink and expand): a slot's block of rows from the segment table, a tile
of the shrink's input through its prologue, a row's RMS, and the add into the base output."""

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
def prologue_tile(x_rows, norm_ptr, offs_k, mask_m, K, NORM: tl.constexpr, SILU_MUL: tl.constexpr):
    """[BLOCK_M, BLOCK_K] float32 of the shrink's input at columns offs_k: x, silu(gate) * up of x = [gate | up],
    or x times the norm's weight (the 1 / rms(x) factor is applied to the product, row_inv_rms)."""
    mask_k = offs_k < K
    mask_x = mask_m[:, None] & mask_k[None, :]
    x = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(x_rows + K + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    if NORM:
        x = x * tl.load(norm_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
    return x


@triton.jit
def row_inv_rms(x_rows, mask_m, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] 1 / rms of each whole row (a few KB read again from L2 at decode sizes)."""
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        sum_sq += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
    return tl.rsqrt(sum_sq / K + eps)


@triton.jit
def add_into(out_ptr, tokens, offs_n, mask_m, mask_n, stride_o, delta):
    """out[tokens, offs_n] += delta, in out's dtype (each token sits in one segment: no other program touches
    its row's columns)."""
    out_ptrs = out_ptr + tokens[:, None] * stride_o + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)
