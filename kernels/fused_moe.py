"""Fused mixture-of-experts MLP: a grouped GEMM over tokens sorted by expert (SwiGLU experts).

Each token picks top_k experts. `align_by_expert` sorts the T * top_k (token, expert) pairs by expert
and pads each expert's run to a multiple of BLOCK_M, so that every BLOCK_M-row tile of the sorted list
belongs to one expert. Two launches of one kernel then do all experts at once:

    up:   inter[pair] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)   (GATED)
    down: y[pair]     = weight[pair] * (inter[pair] @ w2[e].T)                       (ROUTED_WEIGHT)

and out[token] = sum over its top_k pairs of y. A tile reads its expert's weight once for up to
BLOCK_M tokens, and only the chosen experts' weights are read at all (what batch-1 decode needs).
The grid covers the worst-case padded length, and tiles past the real one exit at once: the launch
shape depends only on T, so a decode step with this kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass
class ExpertAlignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32: index t * top_k + j of each row, num_pairs = padding
    tile_experts: torch.Tensor  # [max_padded // block_m] int32: the expert of each tile
    num_padded: torch.Tensor  # [1] int32: rows actually used (a multiple of block_m)
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sorts the pairs of topk_ids [T, top_k] by expert, each expert's run padded to block_m rows.
    All on the device, no host sync: the output sizes depend only on T * top_k."""
    flat = topk_ids.flatten().to(torch.int64)  # [N]
    num_pairs = flat.shape[0]
    # scatter_add, not bincount: bincount on CUDA reads the max on the host (no graph capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pair indices, grouped by expert
    experts_sorted = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts_sorted]
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(padded_end - padded)[experts_sorted] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertAlignment(sorted_pairs, tile_experts.to(torch.int32), padded_end[-1:].to(torch.int32), block_m)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x (rows = tokens, read through pair // TOP_K) or inter (rows = pairs)
    w_ptr,  # [E, N_w, K]
    out_ptr,  # [num_pairs, N]
    sorted_pairs_ptr,
    tile_experts_ptr,
    num_padded_ptr,
    pair_weights_ptr,  # [num_pairs] fp32 (ROUTED_WEIGHT only)
    num_pairs,
    N,  # output columns (I when GATED: w holds 2I rows, gate then up)
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    A_ROWS_ARE_TOKENS: tl.constexpr,
    GATED: tl.constexpr,
    ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    mask_m = pairs < num_pairs
    a_rows = pairs // TOP_K if A_ROWS_ARE_TOKENS else pairs
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows
            w_up = tl.load(w_ptrs + N * stride_wn, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if ROUTED_WEIGHT:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=mask_m, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    pair_weights: torch.Tensor | None,
    top_k: int,
    a_rows_are_tokens: bool,
    gated: bool,
    block_n: int,
    block_k: int,
) -> None:
    num_pairs, n = out.shape
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    grid = (alignment.sorted_pairs.shape[0] // alignment.block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        alignment.sorted_pairs,
        alignment.tile_experts,
        alignment.num_padded,
        pair_weights if pair_weights is not None else out,
        num_pairs,
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=top_k,
        A_ROWS_ARE_TOKENS=a_rows_are_tokens,
        GATED=gated,
        ROUTED_WEIGHT=pair_weights is not None,
        BLOCK_M=alignment.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: small when each expert gets a few tokens (decode), larger once they get many."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] fp32
    topk_ids: torch.Tensor,  # [T, top_k]
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    alignment = align_by_expert(topk_ids, num_experts, block_m or choose_block_m(num_pairs, num_experts))
    inter = torch.empty(num_pairs, two_inter // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, inter, alignment, None, top_k, True, True, block_n, block_k)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    _grouped_gemm(inter, w2, y, alignment, weights, top_k, False, False, block_n, block_k)
    return y.view(num_tokens, top_k, hidden).sum(1)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Expert by expert, as transformers' eager loop: each expert runs on the tokens that chose it."""
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        tokens, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, (y * topk_weights[tokens, slot, None]).to(x.dtype))
    return out
