"""LoRA shrink: each token's activations times its adapter slot's A (all slices of a fused projection at once),
with the prologue the base projection's fused kernel ran on the same input (so a LoRA step keeps that fusion):
the RMS norm of a pre-norm row, or SiLU-and-mul of a [gate | up] row.

Split over K at decode sizes, each split writes its own partial sums (no zeroing launch, no atomics); the expand
adds the splits up as it reads them. A norm prologue's 1 / rms(x) is a factor of the whole row, so each split also
writes its columns' sum of squares and the expand applies the factor to the summed row: no split reads the whole row
(each did, once per split: at 64 rows half of a serving step's shrink time, H100).

An FP8 base's A (tgi_compat/modeling/lora/folding.py) is e4m3 with a scale per row: its tiles are widened to the
activations' dtype for the product (exact) and each split's sums scaled per column as they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.lora.segments import LoraSegments
from tgi_compat.kernels.lora.tiles import block_rows, prologue_tile, segment_block, segment_blocks, table_block
from tgi_compat.kernels.pdl import launch_options, use_pdl


@dataclass(frozen=True, slots=True)
class ShrinkPrologue:
    """What the shrink runs on x before A: the RMS norm (x the pre-norm rows), or SiLU-and-mul (x = [gate | up])."""

    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    silu_mul: bool = False


NO_PROLOGUE = ShrinkPrologue()


@dataclass(frozen=True, slots=True)
class Shrunk:
    """The shrink's output, rows in token_order's order: partial sums over K [P, T, N] float32 and, after a norm
    prologue, each split's sums of squares of its columns [P, T] with the norm's column count and eps: the row's
    value is partials.sum(0) / rms."""

    partials: torch.Tensor
    sum_sq: torch.Tensor | None = None
    norm_cols: int = 0
    eps: float = 0.0

    def rows(self) -> torch.Tensor:
        """[T, N] float32: each row's prologue(x) @ A[slot]^T."""
        total = self.partials.sum(0)
        if self.sum_sq is None:
            return total
        return total * torch.rsqrt(self.sum_sq.sum(0) / self.norm_cols + self.eps)[:, None]


@triton.jit
def _a_tile(a_rows, offs_k, mask_n, K):
    """[BLOCK_K, BLOCK_N] of a slot's A^T: columns offs_k of its rows offs_n (a_rows: their pointers)."""
    return tl.load(a_rows + offs_k[:, None], mask=mask_n[None, :] & (offs_k < K)[:, None], other=0.0)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K] ([T, 2K]: gate | up with SILU_MUL)
    a_ptr,  # [L, N, K]: every slot's stacked A (N = slices x max rank)
    norm_ptr,  # [K]: the RMS norm's weight (NORM)
    order_ptr,  # [T] int64: token indices sorted by slot
    seg_start_ptr,  # [L] int64: each slot's first row in order
    seg_len_ptr,  # [L] int64: each slot's token count (0: idle slot)
    out_ptr,  # [SPLIT_K, T, N] float32, rows in sorted order: each split's partial sums
    sum_sq_ptr,  # [SPLIT_K, T] float32 (NORM): each split's sums of squares of its columns of x
    a_scale_ptr,  # [L, N] float32 (A_SCALED): each A row's scale
    T,
    L,
    K,
    N,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_o_split,
    stride_o,
    stride_q_split,
    stride_s_slot,
    NORM: tl.constexpr,
    A_SCALED: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_L: tl.constexpr,  # segment_block's table width
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the base projection (Hopper)
):
    slot, first, left = segment_block(seg_start_ptr, seg_len_ptr, L, T, BLOCK_M, BLOCK_L, False)
    if slot >= 0:  # programs past the last block stop here
        pid_n = tl.program_id(1) // SPLIT_K
        pid_k = tl.program_id(1) % SPLIT_K
        mask_m, rows, tokens = block_rows(order_ptr, first, left, BLOCK_M)
        x_rows = x_ptr + tokens[:, None] * stride_x
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_n[None, :] * stride_a_row
        # this program's share of K: whole BLOCK_Ks, interleaved with the other splits'; its first tile of A is read
        # before the wait (no kernel of the step writes A), the next one before each tile's product
        k_first, k_step = pid_k * BLOCK_K, SPLIT_K * BLOCK_K
        a = _a_tile(a_rows, k_first + tl.arange(0, BLOCK_K), mask_n, K)
        if USE_PDL:  # x is the previous kernel's output (the segment table is the step's first kernels')
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(k_first, K, k_step):
            offs_k = k + tl.arange(0, BLOCK_K)
            x = prologue_tile(x_rows, offs_k, mask_m, K, SILU_MUL)
            if NORM:  # x's squares before the weight: its share of the row's mean square
                sum_sq += tl.sum(x * x, axis=1)
                x = x * tl.load(norm_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
            a_next = _a_tile(a_rows, offs_k + k_step, mask_n, K)  # (past K: masked, zeros)
            if A_SCALED:  # FP8 A: widened to the activations' dtype (exact), its row scales applied below
                acc += tl.dot(x.to(x_ptr.dtype.element_ty), a.to(x_ptr.dtype.element_ty))
            else:  # the weights' dtype on the tensor cores (bf16 in serving), accumulated in float32
                acc += tl.dot(x.to(a.dtype), a)
            a = a_next
        if USE_PDL:  # the expand may start and read its B
            tl.extra.cuda.gdc_launch_dependents()
        if A_SCALED:
            acc *= tl.load(a_scale_ptr + slot.to(tl.int64) * stride_s_slot + offs_n, mask=mask_n, other=0.0)[None, :]
        out_ptrs = out_ptr + pid_k * stride_o_split + rows[:, None] * stride_o + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])
        if NORM:
            if pid_n == 0:  # (every N block summed the same squares)
                tl.store(sum_sq_ptr + pid_k * stride_q_split + rows, sum_sq, mask=mask_m)


def shrink_split_k(num_tokens: int, k: int) -> int:
    """Splits of K: at decode sizes a slot's few rows make one program per N block, so K is cut into pieces of
    >= 256 columns (16 for K = 4096, 32 for 14336) to spread one slot's A over many SMs; a prefill-sized step
    has programs enough along M."""
    if num_tokens > 256:
        return 1
    return max(1, min(32, k // 256))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    step: LoraSegments,
    prologue: ShrinkPrologue = NO_PROLOGUE,
    split_k: int | None = None,  # None: shrink_split_k's (benchmarks/device/lora_kernels.py sweeps others)
    pdl: bool | None = None,  # None: on Hopper (tgi_compat.kernels.pdl)
    a_scale: torch.Tensor | None = None,  # [L, N] float32: an FP8 A's row scales
) -> Shrunk:
    """x [T, K] (the pre-norm rows with a norm prologue; [T, 2K] gate | up with SiLU-and-mul), a [L, N, K] ->
    each LoRA token's prologue(x) @ (A[slot] * a_scale[slot])^T as P partial sums over K (rows of tokens without an
    adapter: unset)."""
    num_tokens, k = x.shape[0], a.shape[2]
    num_slots, n, _ = a.shape
    norm_weight, silu_mul = prologue.norm_weight, prologue.silu_mul
    assert x.shape[1] == (2 * k if silu_mul else k), (x.shape, a.shape)
    split_k = split_k or shrink_split_k(num_tokens, k)
    pdl = use_pdl(x) if pdl is None else pdl
    out = torch.empty(split_k, num_tokens, n, dtype=torch.float32, device=x.device)
    norm = norm_weight is not None
    sum_sq = torch.empty(split_k, num_tokens, dtype=torch.float32, device=x.device) if norm else out
    block_m, block_n, block_k = 16, min(64, max(16, triton.next_power_of_2(n))), 64
    grid = (segment_blocks(num_tokens, num_slots, block_m), triton.cdiv(n, block_n) * split_k)
    _lora_shrink_kernel[grid](
        x, a, x if norm_weight is None else norm_weight, step.token_order, step.seg_start, step.seg_len, out, sum_sq,
        out if a_scale is None else a_scale,
        num_tokens, num_slots, k, n,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0), out.stride(1), sum_sq.stride(0),
        0 if a_scale is None else a_scale.stride(0),
        NORM=norm, A_SCALED=a_scale is not None, SILU_MUL=silu_mul,
        BLOCK_M=block_m, BLOCK_L=table_block(num_slots), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        USE_PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return Shrunk(out, sum_sq, k, prologue.eps) if norm else Shrunk(out)


def lora_shrink_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    step: LoraSegments,
    prologue: ShrinkPrologue = NO_PROLOGUE,
    a_scale: torch.Tensor | None = None,
) -> Shrunk:
    """The definition, one matmul per live segment, as one normed 'split' [1, T, N] (also the CPU path: the host
    reads the segment table)."""
    x = shrink_prologue_ref(x, prologue)
    out = torch.zeros(1, x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, (start, length) in enumerate(zip(step.seg_start.tolist(), step.seg_len.tolist())):
        if length:
            tokens = step.token_order[start : start + length]
            a_rows = a[slot].float() if a_scale is None else a[slot].float() * a_scale[slot][:, None]
            out[0, start : start + length] = x[tokens] @ a_rows.T
    return Shrunk(out)


def shrink_prologue_ref(x: torch.Tensor, prologue: ShrinkPrologue) -> torch.Tensor:
    """The shrink's input in float32: x, its RMS norm (x * w / rms(x)), or silu(gate) * up."""
    x = x.float()
    if prologue.silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    if prologue.norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + prologue.eps) * prologue.norm_weight.float()
    return x
