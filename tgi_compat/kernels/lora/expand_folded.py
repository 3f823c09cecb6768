"""LoRA expand of a folded projection: the base GEMM / GEMV ran over the weight with every slot's A stacked under it
(tgi_compat.modeling.lora.folding), so a token's output row is [base | shrunk of slot 0 | shrunk of slot 1 | ...];
this kernel writes base + shrunk[slot] @ B[slot]^T into a fresh contiguous output, every slice of a fused projection
in one launch.

Over the step's segments (tokens sorted by slot, tgi_compat.modeling.lora.step), so that a program's rows share their
slot and read its tile of B once: with one row a program each row read B again (64 rows of gate|up: ~59 MB from L2 a
projection; 7-8 us a launch, H100, 2026-12-06). One more segment, past the slots, holds the base rows, whose programs
copy their base columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.lora.segments import LoraSegments
from tgi_compat.kernels.lora.tiles import block_rows, segment_block, segment_blocks, table_block
from tgi_compat.kernels.pdl import launch_options, use_pdl

# output columns per program (x R = 16 ranks: a 4 KB tile of B at bf16), rows per program (tl.dot's least)
EXPAND_FOLDED_BLOCK_N, EXPAND_FOLDED_BLOCK_M = 128, 16


@triton.jit
def _lora_expand_folded_kernel(
    full_ptr,  # [T, N + L * S * R]: the folded projection's output, base columns first
    order_ptr,  # [T] int64: token indices sorted by slot, base tokens last
    seg_start_ptr,  # [L] int64
    seg_len_ptr,  # [L] int64
    b_ptr,  # [L, N, R]: every slot's B, all slices' output columns stacked
    out_ptr,  # [T, N] contiguous, written
    T,
    L,
    end0,  # slice 0's last output column + 1
    end1,  # slice 1's (fused projections of 2 or 3 parts)
    N,  # the base columns: the last slice's end
    R,  # max rank
    stride_full,
    stride_b_slot,
    stride_b_row,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_L: tl.constexpr,  # segment_block's table width
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the base projection (Hopper)
):
    # slot L: the base rows
    slot, first, left = segment_block(seg_start_ptr, seg_len_ptr, L, T, BLOCK_M, BLOCK_L, True)
    if slot >= 0:  # programs past the last block stop here
        lora_slot = tl.minimum(slot, L - 1)
        mask_m, _, tokens = block_rows(order_ptr, first, left, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = (offs_r < R) & (offs_r * 0 + slot < L)  # the base segment reads no rank (a vector: the interpreter)
        # B is read before the wait: no kernel of the step writes it
        b = tl.load(
            b_ptr + lora_slot.to(tl.int64) * stride_b_slot + offs_n[None, :] * stride_b_row + offs_r[:, None],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N]
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # the base projection's output
            tl.extra.cuda.gdc_launch_dependents()
        full_rows = full_ptr + tokens[:, None] * stride_full
        mask_mn = mask_m[:, None] & mask_n[None, :]
        out = tl.load(full_rows + offs_n[None, :], mask=mask_mn, other=0.0).to(tl.float32)
        # each column's slice: how many slice ends lie at or before it
        column_slice = (offs_n >= end0).to(tl.int32)
        if NUM_SLICES > 2:
            column_slice += (offs_n >= end1).to(tl.int32)
        shrunk_rows = full_rows + N + lora_slot * (NUM_SLICES * R) + offs_r[None, :]
        mask_mr = mask_m[:, None] & mask_r[None, :]
        for s in tl.static_range(NUM_SLICES):
            shrunk = tl.load(shrunk_rows + s * R, mask=mask_mr, other=0.0)  # [BLOCK_M, BLOCK_R], the output's dtype
            out += tl.where((column_slice == s)[None, :], tl.dot(shrunk, b.to(shrunk.dtype)), 0.0)
        out_tile = out_ptr + tokens[:, None] * N + offs_n[None, :]
        tl.store(out_tile, out.to(out_ptr.dtype.element_ty), mask=mask_mn)


def lora_expand_folded(
    full: torch.Tensor,
    step: LoraSegments,
    b: torch.Tensor,
    slice_ends: tuple[int, ...],
    block_n: int = EXPAND_FOLDED_BLOCK_N,
    pdl: bool | None = None,  # None: on Hopper (tgi_compat.kernels.pdl)
    num_warps: int = 4,  # (benchmarks/device/lora_kernels.py sweeps it with block_n)
) -> torch.Tensor:
    """full [T, N + L * S * R] (a folded projection's output), b [L, N, R] -> [T, N]: full[:, :N] plus each LoRA
    token's shrunk[slot] @ B[slot]^T per slice (slice s's columns end at slice_ends[s], the last at N)."""
    num_slots, n, rank = b.shape
    num_tokens = full.shape[0]
    assert 1 <= len(slice_ends) <= 3 and slice_ends[-1] == n, (slice_ends, b.shape)
    assert full.shape[1] == n + num_slots * len(slice_ends) * rank and full.stride(1) == 1, (full.shape, b.shape)
    ends = (*slice_ends, *[slice_ends[-1]] * (3 - len(slice_ends)))
    out = torch.empty(num_tokens, n, dtype=full.dtype, device=full.device)
    pdl = use_pdl(full) if pdl is None else pdl
    block_m = EXPAND_FOLDED_BLOCK_M
    grid = (segment_blocks(num_tokens, num_slots + 1, block_m), triton.cdiv(n, block_n))
    _lora_expand_folded_kernel[grid](
        full, step.token_order, step.seg_start, step.seg_len, b, out, num_tokens, num_slots, ends[0], ends[1], n, rank,
        full.stride(0), b.stride(0), b.stride(1),
        NUM_SLICES=len(slice_ends), BLOCK_M=block_m, BLOCK_L=table_block(num_slots + 1), BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), USE_PDL=pdl, num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
    return out


def lora_expand_folded_ref(
    full: torch.Tensor, step: LoraSegments, b: torch.Tensor, slice_ends: tuple[int, ...]
) -> torch.Tensor:
    """The definition (also the CPU path): one matmul per LoRA row and slice."""
    num_slots, n, rank = b.shape
    shrunk = full[:, n:].float().view(full.shape[0], num_slots, len(slice_ends) * rank)
    out = full[:, :n].clone()
    for row, slot in enumerate(step.token_slots.tolist()):
        if slot < 0:
            continue
        for index, (begin, end) in enumerate(zip((0, *slice_ends[:-1]), slice_ends)):
            part = shrunk[row, slot, index * rank : (index + 1) * rank]
            out[row, begin:end] = (full[row, begin:end].float() + b[slot, begin:end].float() @ part).to(out.dtype)
    return out
