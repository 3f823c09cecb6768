"""The (token, expert) pairs sorted by expert, each expert's run padded to a multiple of the grouped GEMM's
BLOCK_M, so that every BLOCK_M-row tile of the sorted list belongs to one expert: one Triton program (no host
sync, no data-dependent shapes, so a decode step with it is captured in a CUDA graph), or torch ops for a long
prefill."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The one-program Triton alignment up to this many pairs; a long prefill sorts with torch ops
ALIGN_KERNEL_MAX_PAIRS = 4096


@dataclass
class ExpertAlignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32: pair index of each row, num_pairs = padding
    tile_experts: torch.Tensor  # [max_padded // block_m] int32: the expert of each tile
    num_padded: torch.Tensor  # [1] int32: rows actually used (a multiple of block_m)
    block_m: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted list in the worst case: every expert's run one row past a tile boundary."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


@triton.jit
def _align_kernel(
    topk_ids_ptr,  # [num_pairs], any integer dtype
    sorted_pairs_ptr,  # [max_padded] int32
    tile_experts_ptr,  # [max_padded // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    num_experts,
    max_padded,
    BLOCK_M: tl.constexpr,
    E_BLOCK: tl.constexpr,  # experts, padded to a power of two
    CHUNK: tl.constexpr,  # pairs (or rows) per step
):
    """One program: count pairs per expert, lay the padded runs out, scatter every pair to its row
    (its expert's start + its rank among that expert's pairs), then fill the padding rows and the
    tile -> expert map. The real and the padding rows are disjoint sets, so no barrier is needed."""
    experts = tl.arange(0, E_BLOCK)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([E_BLOCK], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(topk_ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)

    placed = tl.zeros([E_BLOCK], tl.int32)  # pairs of each expert already given a row
    for start in range(0, num_pairs, CHUNK):
        valid = start + offs < num_pairs
        ids = tl.load(topk_ids_ptr + start + offs, mask=valid, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_BLOCK]
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert in this chunk
        row = tl.sum(onehot * (before + (padded_start + placed)[None, :]), axis=1)
        tl.store(sorted_pairs_ptr + row, start + offs, mask=valid)
        placed += tl.sum(onehot, axis=0)

    real_expert = experts < num_experts
    for start in range(0, max_padded, CHUNK):
        rows = start + offs
        # the expert whose padded run holds this row: how many runs end at or before it
        expert = tl.sum(((padded_end[None, :] <= rows[:, None]) & real_expert[None, :]).to(tl.int32), axis=1)
        mine = (experts[None, :] == expert[:, None]).to(tl.int32)
        filled = tl.sum(mine * (padded_start + counts)[None, :], axis=1)  # first padding row of that run
        is_padding = (rows >= filled) | (rows >= total)
        tl.store(sorted_pairs_ptr + rows, num_pairs, mask=(rows < max_padded) & is_padding)
    for start in range(0, max_padded // BLOCK_M, CHUNK):
        tiles = start + offs
        first_rows = tiles * BLOCK_M
        expert = tl.sum(((padded_end[None, :] <= first_rows[:, None]) & real_expert[None, :]).to(tl.int32), axis=1)
        tl.store(tile_experts_ptr + tiles, tl.minimum(expert, num_experts - 1), mask=first_rows < max_padded)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sorts the pairs of topk_ids [T, top_k] by expert, each expert's run padded to block_m rows.
    All on the device, no host sync: the output sizes depend only on T * top_k."""
    num_pairs = topk_ids.numel()
    if num_pairs > ALIGN_KERNEL_MAX_PAIRS:
        return align_by_expert_torch(topk_ids, num_experts, block_m)
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)
    tile_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    e_block = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 4096 // e_block))  # keeps the [CHUNK, E_BLOCK] one-hot at <= 4096 elements
    _align_kernel[(1,)](
        topk_ids.flatten(),
        sorted_pairs,
        tile_experts,
        num_padded,
        num_pairs,
        num_experts,
        max_padded,
        BLOCK_M=block_m,
        E_BLOCK=e_block,
        CHUNK=chunk,
    )
    return ExpertAlignment(sorted_pairs, tile_experts, num_padded, block_m)


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """align_by_expert in torch ops (a dozen launches; for long prefills, where they cost nothing)."""
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
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(padded_end - padded)[experts_sorted] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertAlignment(sorted_pairs, tile_experts.to(torch.int32), padded_end[-1:].to(torch.int32), block_m)
