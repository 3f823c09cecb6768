"""LoRA expand: each token's shrunk row (one slice's rank block) times its slot's B, added into the base output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr,  # [T, N] float32, rows in sorted order
    b_ptr,  # [L, OUT, R]: every slot's B (rows of this slice from out_offset)
    order_ptr,  # [T] int64
    seg_start_ptr,  # [L] int64
    seg_len_ptr,  # [L] int64
    out_ptr,  # [T, OUT_TOTAL], added into
    rank_offset,  # this slice's first column of shrunk
    out_offset,  # this slice's first output column
    out_size,  # this slice's output columns
    R,  # max rank
    stride_s,
    stride_b_slot,
    stride_b_row,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    slot = tl.program_id(1)
    num_tokens = tl.load(seg_len_ptr + slot)
    if tl.program_id(0) * BLOCK_M < num_tokens:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < num_tokens
        rows = tl.load(seg_start_ptr + slot) + offs_m
        tokens = tl.load(order_ptr + rows, mask=mask_m, other=0)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < out_size
        s = tl.load(
            shrunk_ptr + rows[:, None] * stride_s + rank_offset + offs_r[None, :],
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_b_slot + (out_offset + offs_n[None, :]) * stride_b_row + offs_r[:, None],
            mask=mask_n[None, :] & mask_r[:, None],
            other=0.0,
        )
        delta = tl.dot(s, b.to(tl.float32))  # [BLOCK_M, BLOCK_N]
        # each token sits in one segment: no other program touches its row
        out_ptrs = out_ptr + tokens[:, None] * stride_o + out_offset + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        base = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand(
    out: torch.Tensor,
    shrunk: torch.Tensor,
    b: torch.Tensor,
    token_order: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    rank_offset: int,
    out_offset: int,
    out_size: int,
) -> None:
    """out[:, out_offset : out_offset + out_size] += each LoRA token's shrunk[:, rank_offset : + R] @ B[slot]^T,
    B = b[:, out_offset : out_offset + out_size] ([L, OUT, R]); rows of tokens without an adapter are left alone."""
    num_slots, _, rank = b.shape
    block_m, block_n = 16, 64
    grid = (triton.cdiv(out.shape[0], block_m), num_slots, triton.cdiv(out_size, block_n))
    _lora_expand_kernel[grid](
        shrunk, b, token_order, seg_start, seg_len, out, rank_offset, out_offset, out_size, rank,
        shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
    )  # fmt: skip


def lora_expand_ref(
    out: torch.Tensor,
    shrunk: torch.Tensor,
    b: torch.Tensor,
    token_order: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    rank_offset: int,
    out_offset: int,
    out_size: int,
) -> None:
    """The definition, one matmul per live segment (also the CPU path)."""
    rank = b.shape[2]
    columns = slice(out_offset, out_offset + out_size)
    for slot, (start, length) in enumerate(zip(seg_start.tolist(), seg_len.tolist())):
        if length:
            tokens = token_order[start : start + length]
            delta = shrunk[start : start + length, rank_offset : rank_offset + rank] @ b[slot, columns].float().T
            out[tokens, columns] += delta.to(out.dtype)
