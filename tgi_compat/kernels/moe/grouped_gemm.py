"""The grouped GEMM over pairs sorted by expert (tgi_compat/kernels/moe/align.py): one launch does every expert's
up (GATED: silu(gate) * up) or down projection (ROUTED_WEIGHT: scaled by the pair's routing weight), a tile
reading its expert's weight once for up to BLOCK_M tokens. The grid covers the worst-case padded length, and
tiles past the real one exit at once: the launch shape depends only on T."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.moe.align import ExpertAlignment
from tgi_compat.kernels.moe.configs import LaunchConfig

_SHARED_MEMORY_BYTES = 160 * 1024  # pipelined tiles of a grouped-GEMM program (H100: 227 KB; the rest for the epilogue)


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
    num_tiles,  # worst-case tiles (the grid's rows)
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
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # programs walk GROUP_M tiles down one column block before moving right
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_tile = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_tiles - first_tile, GROUP_M)
    tile = first_tile + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    mask_m = pairs < num_pairs
    a_rows = pairs // TOP_K if A_ROWS_ARE_TOKENS else pairs
    a_rows = tl.where(mask_m, a_rows, 0)  # padding rows read row 0 and are not stored
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
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


def _fit_shared_memory(config: LaunchConfig, block_m: int, gated: bool, elem_bytes: int) -> int:
    """num_stages, lowered until the pipelined tiles fit in shared memory (fp32 tiles are twice bf16's)."""
    per_stage = (block_m * config.block_k + (2 if gated else 1) * config.block_k * config.block_n) * elem_bytes
    stages = config.num_stages
    while stages > 1 and stages * per_stage > _SHARED_MEMORY_BYTES:
        stages -= 1
    return stages


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    pair_weights: torch.Tensor | None,
    top_k: int,
    a_rows_are_tokens: bool,
    gated: bool,
    config: LaunchConfig,
) -> None:
    num_pairs, n = out.shape
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    num_tiles = alignment.sorted_pairs.shape[0] // alignment.block_m
    grid = (num_tiles * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        alignment.sorted_pairs,
        alignment.tile_experts,
        alignment.num_padded,
        pair_weights if pair_weights is not None else out,
        num_pairs,
        num_tiles,
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
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=_fit_shared_memory(config, alignment.block_m, gated, a.element_size()),
    )
