"""LoRA shrink: each token's activations times its adapter slot's A (all slices of a fused projection at once)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [L, N, K]: every slot's stacked A (N = slices x max rank)
    order_ptr,  # [T] int64: token indices sorted by slot
    seg_start_ptr,  # [L] int64: each slot's first row in order
    seg_len_ptr,  # [L] int64: each slot's token count (0: idle slot)
    out_ptr,  # [T, N] float32, rows in sorted order (zeroed first when SPLIT_K > 1)
    K,
    N,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    slot = tl.program_id(1)
    num_tokens = tl.load(seg_len_ptr + slot)
    if tl.program_id(0) * BLOCK_M < num_tokens:  # blocks past the segment (most, for idle slots) stop here
        pid_n = tl.program_id(2) // SPLIT_K
        pid_k = tl.program_id(2) % SPLIT_K
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < num_tokens
        rows = tl.load(seg_start_ptr + slot) + offs_m
        tokens = tl.load(order_ptr + rows, mask=mask_m, other=0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # this program's share of K: whole BLOCK_Ks, interleaved with the other splits'
        for k in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(
                x_ptr + tokens[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            a = tl.load(
                a_base + offs_n[None, :] * stride_a_row + offs_k[:, None],
                mask=mask_n[None, :] & mask_k[:, None],
                other=0.0,
            )
            # the weights' dtype on the tensor cores (bf16 in serving), accumulated in float32
            acc += tl.dot(x.to(a.dtype), a)
        out_ptrs = out_ptr + rows[:, None] * stride_o + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc, mask=mask)
        else:
            tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")  # only the sum matters: no ordering


def shrink_split_k(num_tokens: int, k: int) -> int:
    """Splits of K: at decode sizes a slot's few rows make one program per N block, so K is cut into pieces of
    >= 256 columns (16 for K = 4096, 32 for 14336) to spread one slot's A over many SMs; a prefill-sized step
    has programs enough along M."""
    if num_tokens > 256:
        return 1
    return max(1, min(32, k // 256))


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, token_order: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor
) -> torch.Tensor:
    """x [T, K], a [L, N, K] -> [T, N] float32 in token_order's order (rows of tokens without an adapter: unset,
    or zero)."""
    num_tokens, k = x.shape
    num_slots, n, _ = a.shape
    split_k = shrink_split_k(num_tokens, k)
    alloc = torch.empty if split_k == 1 else torch.zeros
    out = alloc(num_tokens, n, dtype=torch.float32, device=x.device)
    block_m, block_n, block_k = 16, min(64, max(16, triton.next_power_of_2(n))), 64
    grid = (triton.cdiv(num_tokens, block_m), num_slots, triton.cdiv(n, block_n) * split_k)
    _lora_shrink_kernel[grid](
        x, a, token_order, seg_start, seg_len, out, k, n, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
    )  # fmt: skip
    return out


def lora_shrink_ref(
    x: torch.Tensor, a: torch.Tensor, token_order: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor
) -> torch.Tensor:
    """The definition, one matmul per live segment (also the CPU path: the host reads the segment table)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, (start, length) in enumerate(zip(seg_start.tolist(), seg_len.tolist())):
        if length:
            tokens = token_order[start : start + length]
            out[start : start + length] = x[tokens].float() @ a[slot].float().T
    return out
