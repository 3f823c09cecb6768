"""The MoE router's softmax, top-k and optional renormalisation in one launch a step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] router logits, any float dtype
    weights_ptr,  # [T, TOP_K] fp32
    ids_ptr,  # [T, TOP_K] int32
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """One token per program: softmax in fp32, then the top_k by repeated argmax (largest first, the
    lower expert on a tie), divided by their sum when RENORMALIZE."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_BLOCK)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(valid, probs / tl.sum(probs, axis=0), -1.0)  # below every probability
    total = 1.0
    if RENORMALIZE:
        total = 0.0
        remaining = probs
        for _ in tl.static_range(TOP_K):
            best = tl.argmax(remaining, axis=0)
            total += tl.max(remaining, axis=0)
            remaining = tl.where(offs == best, -1.0, remaining)
    remaining = probs
    for j in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=0)
        tl.store(weights_ptr + row * TOP_K + j, tl.max(remaining, axis=0) / total)
        tl.store(ids_ptr + row * TOP_K + j, best.to(tl.int32))
        remaining = tl.where(offs == best, -1.0, remaining)


def fused_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref in one launch instead of five (the decode step's graph has one node per layer for it)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        assert router_logits.stride(1) == 1
        _route_kernel[(num_tokens,)](
            router_logits,
            weights,
            ids,
            num_experts,
            router_logits.stride(0),
            TOP_K=top_k,
            E_BLOCK=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= 256 else 4,
        )
    return weights, ids


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, expert ids [T, top_k]): softmax in fp32, top-k, maybe renormalised."""
    weights, ids = router_logits.float().softmax(-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids
