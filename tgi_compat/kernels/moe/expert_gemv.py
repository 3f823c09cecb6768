"""The MoE block's GEMV path for a decode step of a few tokens: no sort, no tiles of padding. The up kernel's
programs own (pair, BLOCK_N columns) and read the pair's expert straight from topk_ids; the down kernel's programs
own (token, BLOCK_N columns), walk the token's top_k experts and write the routed sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.moe.configs import LaunchConfig


@triton.jit
def _moe_gemv_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]: gate rows, then up rows
    topk_ids_ptr,  # [T * TOP_K]
    out_ptr,  # [T * TOP_K, N]: silu(gate) * up of each pair
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # clamp instead of masking the weight loads
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    w_gate = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    w_up = w_gate + N * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k_start
        x = tl.load(x_row + k_start + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        gate = tl.load(w_gate + k_start, mask=mask_k[None, :], other=0.0)
        up = tl.load(w_up + k_start, mask=mask_k[None, :], other=0.0)
        acc_gate += gate.to(tl.float32) * x[None, :]
        acc_up += up.to(tl.float32) * x[None, :]
    gate_sum = tl.sum(acc_gate, axis=1)
    up_sum = tl.sum(acc_up, axis=1)
    y = gate_sum * tl.sigmoid(gate_sum) * up_sum
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _moe_gemv_down_kernel(
    inter_ptr,  # [T * TOP_K, K]
    w_ptr,  # [E, N, K]
    topk_ids_ptr,  # [T * TOP_K]
    topk_weights_ptr,  # [T * TOP_K] fp32
    out_ptr,  # [T, N]: the routed sum over the token's experts
    N,
    K,
    stride_im,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
        inter_row = inter_ptr + pair.to(tl.int64) * stride_im
        w_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k_start in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k_start
            h = tl.load(inter_row + k_start + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k_start, mask=mask_k[None, :], other=0.0)
            acc += w.to(tl.float32) * h[None, :]
        out += tl.sum(acc, axis=1) * tl.load(topk_weights_ptr + pair)
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _launch_moe_gemv(
    kernel,
    num_programs: int,
    operands: tuple[torch.Tensor, ...],
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    config: LaunchConfig,
) -> torch.Tensor:
    """Both GEMV-path kernels over (num_programs, N / BLOCK_N): their tensor operands, then N (out's width),
    K (a's width) and the strides of a [rows, K], w [E, N', K] and out."""
    assert a.stride(1) == 1 and w.stride(2) == 1
    n = out.shape[1]
    kernel[(num_programs, triton.cdiv(n, config.block_n))](
        *operands,
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def moe_gemv_up(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, config: LaunchConfig) -> torch.Tensor:
    """inter [T * top_k, I]: silu(gate) * up of every (token, expert) pair, no sorting."""
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    operands = (x, w13, topk_ids.flatten(), out)
    return _launch_moe_gemv(_moe_gemv_up_kernel, num_tokens * top_k, operands, x, w13, out, top_k, config)


def moe_gemv_down(
    inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: LaunchConfig
) -> torch.Tensor:
    """out [T, H]: each token's sum over its experts of weight * (inter[pair] @ w2[expert].T)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, w2.shape[1], dtype=inter.dtype, device=inter.device)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    operands = (inter, w2, topk_ids.flatten(), weights, out)
    return _launch_moe_gemv(_moe_gemv_down_kernel, num_tokens, operands, inter, w2, out, top_k, config)
