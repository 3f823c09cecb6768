"""LoRA expand of a folded projection, one token row at a time (BGMV): the base GEMM / GEMV ran over the weight with
every slot's A stacked under it (tgi_compat.modeling.lora.weights), so its output row is [base | shrunk of slot 0 |
shrunk of slot 1 | ...]; this kernel writes base + shrunk[slot] @ B[slot]^T into a fresh contiguous output (a base
row: its base columns unchanged), every slice of a fused projection in one launch.

No segment table: each program reads its rows' slots, so the grid is [T / rows a program, output blocks] whatever
the slots are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.pdl import launch_options, use_pdl

# output columns per program (x R = 16 ranks: a 4 KB tile of B at bf16)
EXPAND_ROWS_BLOCK_N = 128
# rows per program: one a program made 3,072 programs of a few dependent loads each for 64 rows of q|k|v, 8 us a
# launch (H100, benchmarks/device/lora_step.py, 2026-12-06)
EXPAND_ROWS_BLOCK_M = 4


@triton.jit
def _lora_expand_rows_kernel(
    full_ptr,  # [T, N + L * S * R]: the folded projection's output, base columns first
    slots_ptr,  # [T] int64: each row's slot, -1 for the base model
    b_ptr,  # [L, N, R]: every slot's B, all slices' output columns stacked
    out_ptr,  # [T, N] contiguous, written
    T,
    end0,  # slice 0's last output column + 1
    end1,  # slice 1's (fused projections of 2 or 3 parts)
    N,  # the base columns: the last slice's end
    R,  # max rank
    stride_full,
    stride_b_slot,
    stride_b_row,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program: each its own slot's tile of B, all loads issued together
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the base projection (Hopper)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < T
    rows = rows.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    slots = tl.load(slots_ptr + rows, mask=mask_m, other=-1)  # (a graph's static input, copied in before the step)
    slots_b = tl.maximum(slots, 0)
    offs_r = tl.arange(0, BLOCK_R)
    mask_mr = (slots >= 0)[:, None] & (offs_r < R)[None, :]  # [BLOCK_M, BLOCK_R]: a base row reads no rank
    # B is read before the wait: no kernel of the step writes it
    b = tl.load(
        b_ptr + slots_b[:, None, None] * stride_b_slot + offs_n[None, None, :] * stride_b_row + offs_r[None, :, None],
        mask=mask_mr[:, :, None] & mask_n[None, None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, BLOCK_R, BLOCK_N]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the base projection's output
        tl.extra.cuda.gdc_launch_dependents()
    full_rows = full_ptr + rows[:, None] * stride_full
    mask_mn = mask_m[:, None] & mask_n[None, :]
    base = tl.load(full_rows + offs_n[None, :], mask=mask_mn, other=0.0)
    # each column's slice: how many slice ends lie at or before it
    column_slice = (offs_n >= end0).to(tl.int32)
    if NUM_SLICES > 2:
        column_slice += (offs_n >= end1).to(tl.int32)
    shrunk_rows = full_rows + N + slots_b[:, None] * (NUM_SLICES * R) + offs_r[None, :]
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(NUM_SLICES):
        shrunk = tl.load(shrunk_rows + s * R, mask=mask_mr, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_R]
        product = tl.sum(shrunk[:, :, None] * b, axis=1)  # [BLOCK_M, BLOCK_N]
        delta += tl.where((column_slice == s)[None, :], product, 0.0)
    out_tile = out_ptr + rows[:, None] * N + offs_n[None, :]
    tl.store(out_tile, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask_mn)


def lora_expand_rows(
    full: torch.Tensor,
    token_slots: torch.Tensor,
    b: torch.Tensor,
    slice_ends: tuple[int, ...],
    block_n: int = EXPAND_ROWS_BLOCK_N,
    pdl: bool | None = None,  # None: on Hopper (tgi_compat.kernels.pdl)
) -> torch.Tensor:
    """full [T, N + L * S * R] (a folded projection's output), token_slots [T] (-1: base), b [L, N, R] ->
    [T, N]: full[:, :N] plus each LoRA row's shrunk[slot] @ B[slot]^T per slice (slice s's columns end at
    slice_ends[s], the last at N)."""
    num_slots, n, rank = b.shape
    num_tokens = full.shape[0]
    assert 1 <= len(slice_ends) <= 3 and slice_ends[-1] == n, (slice_ends, b.shape)
    assert full.shape[1] == n + num_slots * len(slice_ends) * rank and full.stride(1) == 1, (full.shape, b.shape)
    ends = (*slice_ends, *[slice_ends[-1]] * (3 - len(slice_ends)))
    out = torch.empty(num_tokens, n, dtype=full.dtype, device=full.device)
    pdl = use_pdl(full) if pdl is None else pdl
    block_m = min(EXPAND_ROWS_BLOCK_M, triton.next_power_of_2(num_tokens))
    _lora_expand_rows_kernel[(triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))](
        full, token_slots, b, out, num_tokens, ends[0], ends[1], n, rank, full.stride(0), b.stride(0), b.stride(1),
        NUM_SLICES=len(slice_ends), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        USE_PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return out


def lora_expand_rows_ref(
    full: torch.Tensor, token_slots: torch.Tensor, b: torch.Tensor, slice_ends: tuple[int, ...]
) -> torch.Tensor:
    """The definition (also the CPU path): one matmul per LoRA row and slice."""
    num_slots, n, rank = b.shape
    shrunk = full[:, n:].float().view(full.shape[0], num_slots, len(slice_ends) * rank)
    out = full[:, :n].clone()
    for row, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for index, (begin, end) in enumerate(zip((0, *slice_ends[:-1]), slice_ends)):
            part = shrunk[row, slot, index * rank : (index + 1) * rank]
            out[row, begin:end] = (full[row, begin:end].float() + b[slot, begin:end].float() @ part).to(out.dtype)
    return out
