"""A folded row-parallel projection's LoRA term added by the norm kernel after it, not by an expand of its own.

A folded projection's output row is [base | shrunk of every slot] (tgi_compat/modeling/lora/folding.py). For o and
down (one slice each) the residual-add + RMSNorm kernel that reads the row next (tgi_compat/kernels/elementwise/
rmsnorm.py, tgi_compat/kernels/quant/per_token.py) adds shrunk[slot] @ B[slot]^T to the base columns first, rounded
as the folded expand rounds it: one launch fewer per projection, 64 a Llama-3-8B step, each ~4 us at 64 decode rows
(the folded expand alone was 640 us of a 5.9 ms FP8 step, H100, session 28).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class RowDelta:
    """What a norm kernel needs to add a folded projection's LoRA term to its input x = full[:, :N]."""

    full: torch.Tensor  # [T, N + L * R]: the folded projection's output (x is its first N columns, a view)
    token_slots: torch.Tensor  # [T] int64: each row's slot, -1 for the base model
    b: torch.Tensor  # [L, N, R]: every slot's B

    def kernel_args(self) -> tuple:
        """(slots, b, stride of b's slots, stride of its rows, R): the norm kernels' ROW_DELTA arguments."""
        return self.token_slots, self.b, self.b.stride(0), self.b.stride(1), self.b.shape[2]

    @property
    def block_r(self) -> int:
        return max(R_STEP, triton.next_power_of_2(self.b.shape[2]))

    def reference(self) -> torch.Tensor:
        """[T, N] in x's dtype: x plus each LoRA row's delta (the definition; the CPU path)."""
        num_slots, n, rank = self.b.shape
        x = self.full[:, :n]
        shrunk = self.full[:, n:].float().view(x.shape[0], num_slots, rank)
        out = x.clone()
        for row, slot in enumerate(self.token_slots.tolist()):
            if slot >= 0:
                out[row] = (x[row].float() + self.b[slot].float() @ shrunk[row, slot]).to(x.dtype)
        return out


R_STEP = 4  # ranks per pass: a [BLOCK, 4] tile of B in registers beside the row


@triton.jit
def add_row_delta(
    x,  # [BLOCK]: the row's base columns, in the activations' dtype
    full_row_ptr,  # the row of the folded output (its shrunk columns start at N)
    slot_ptr,  # the row's entry of the token slots
    b_ptr,
    stride_b_slot,
    stride_b_row,
    offs,
    mask,
    N,
    R,
    BLOCK_R: tl.constexpr,
    R_STEP: tl.constexpr,
):
    """x + shrunk[slot] @ B[slot]^T at columns offs, rounded to x's dtype once (x itself where the row is a base row)."""
    slot = tl.load(slot_ptr)
    if slot >= 0:
        acc = tl.zeros(x.shape, dtype=tl.float32)
        b_rows = b_ptr + slot * stride_b_slot + offs[:, None].to(tl.int64) * stride_b_row
        for r0 in tl.static_range(0, BLOCK_R, R_STEP):
            ranks = r0 + tl.arange(0, R_STEP)
            mask_r = ranks < R
            shrunk = tl.load(full_row_ptr + N + slot * R + ranks, mask=mask_r, other=0.0).to(tl.float32)
            b = tl.load(b_rows + ranks[None, :], mask=mask[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * shrunk[None, :], axis=1)
        x = (x.to(tl.float32) + acc).to(x.dtype)
    return x
