"""Fused mixture-of-experts MLP (SwiGLU experts): a grouped GEMM over tokens sorted by expert, and a
GEMV path for decode steps with a handful of tokens.

Each token picks top_k experts; a (token, expert) choice is a "pair", numbered t * top_k + j.

Grouped GEMM (`MoeConfig.block_m` > 0). `align_by_expert` (align.py) sorts the T * top_k pairs by expert and
pads each expert's run to a multiple of BLOCK_M, so that every BLOCK_M-row tile of the sorted list
belongs to one expert. Two launches of one kernel (grouped_gemm.py) then do all experts at once:

    up:   inter[pair] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)   (GATED)
    down: y[pair]     = weight[pair] * (inter[pair] @ w2[e].T)                       (ROUTED_WEIGHT)

and out[token] = sum over its top_k pairs of y. A tile reads its expert's weight once for up to
BLOCK_M tokens, and only the chosen experts' weights are read at all. The grid covers the worst-case
padded length, and tiles past the real one exit at once: the launch shape depends only on T, and the
alignment is one Triton program (no host sync, no data-dependent shapes), so a decode step with this
path is captured in a CUDA graph.

GEMV (`MoeConfig.block_m` == 0, expert_gemv.py). With a few tokens every expert's run is one or two rows, so a tile
of at least 16 rows (tl.dot's minimum) is mostly padding, and the sort is a launch of its own. The
GEMV kernels skip both: the up kernel's programs own (pair, BLOCK_N columns) and read the pair's
expert straight from topk_ids; the down kernel's programs own (token, BLOCK_N columns), walk the
token's top_k experts and write the routed sum, so y and its reduction disappear too.

Routing (`fused_route`, routing.py): softmax, top-k and the optional renormalisation in one launch per step.

Block sizes per token count come from `moe_config`: a table (tuned.py) measured by scripts/device/tune_fused_moe.py
on the GPU, keyed by (E, I, H, token bucket), else a rule of thumb.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgi_compat.kernels.moe.align import align_by_expert
from tgi_compat.kernels.moe.configs import LaunchConfig, MoeConfig
from tgi_compat.kernels.moe.expert_gemv import moe_gemv_down, moe_gemv_up
from tgi_compat.kernels.moe.grouped_gemm import grouped_gemm
from tgi_compat.kernels.moe.tuned import TUNED

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# The GEMV path up to this many (token, expert) pairs when no tuned config says otherwise
GEMV_MAX_PAIRS = 8


def token_bucket(num_tokens: int) -> int:
    """The smallest bucket >= num_tokens (the largest for longer batches)."""
    return next((b for b in TOKEN_BUCKETS if b >= num_tokens), TOKEN_BUCKETS[-1])


def default_moe_config(num_tokens: int, num_experts: int, top_k: int) -> MoeConfig:
    """A rule of thumb: GEMV for a few pairs; otherwise tiles tall enough that an expert's run is
    usually one tile (its weights read once), as few rows as that allows."""
    pairs = num_tokens * top_k
    if pairs <= GEMV_MAX_PAIRS:
        gemv = LaunchConfig(block_n=4, block_k=512, num_warps=4, num_stages=1)
        return MoeConfig(0, gemv, gemv)
    per_expert = pairs / num_experts
    block_m = 16 if per_expert <= 8 else 32 if per_expert <= 24 else 64
    few_tiles = pairs <= 4 * num_experts  # decode: a tile or two per expert, so narrow columns fill the GPU
    block_n = 32 if few_tiles else 64
    up = LaunchConfig(block_n=block_n, block_k=128, num_warps=4, num_stages=4, group_m=8)
    down = LaunchConfig(block_n=block_n, block_k=128, num_warps=4, num_stages=4, group_m=8)
    return MoeConfig(block_m, up, down)


def moe_config(num_tokens: int, num_experts: int, top_k: int, inter: int, hidden: int) -> MoeConfig:
    tuned = TUNED.get((num_experts, inter, hidden, token_bucket(num_tokens)))
    return tuned or default_moe_config(num_tokens, num_experts, top_k)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] fp32
    topk_ids: torch.Tensor,  # [T, top_k]
    config: MoeConfig | None = None,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(x)
    config = config or moe_config(num_tokens, num_experts, top_k, two_inter // 2, hidden)
    if config.block_m == 0:
        return moe_gemv_down(moe_gemv_up(x, w13, topk_ids, config.up), w2, topk_weights, topk_ids, config.down)
    num_pairs = num_tokens * top_k
    alignment = align_by_expert(topk_ids, num_experts, config.block_m)
    inter = torch.empty(num_pairs, two_inter // 2, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, inter, alignment, None, top_k, True, True, config.up)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    grouped_gemm(inter, w2, y, alignment, weights, top_k, False, False, config.down)
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
