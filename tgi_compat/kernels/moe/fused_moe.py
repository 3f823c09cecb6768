"""Fused mixture-of-experts MLP (SwiGLU experts): a grouped GEMM over tokens sorted by expert, and a
GEMV path for decode steps with a handful of tokens.

Each token picks top_k experts; a (token, expert) choice is a "pair", numbered t * top_k + j.

Grouped GEMM (`MoeConfig.block_m` > 0). `align_by_expert` sorts the T * top_k pairs by expert and
pads each expert's run to a multiple of BLOCK_M, so that every BLOCK_M-row tile of the sorted list
belongs to one expert. Two launches of one kernel then do all experts at once:

    up:   inter[pair] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)   (GATED)
    down: y[pair]     = weight[pair] * (inter[pair] @ w2[e].T)                       (ROUTED_WEIGHT)

and out[token] = sum over its top_k pairs of y. A tile reads its expert's weight once for up to
BLOCK_M tokens, and only the chosen experts' weights are read at all. The grid covers the worst-case
padded length, and tiles past the real one exit at once: the launch shape depends only on T, and the
alignment is one Triton program (no host sync, no data-dependent shapes), so a decode step with this
path is captured in a CUDA graph.

GEMV (`MoeConfig.block_m` == 0). With a few tokens every expert's run is one or two rows, so a tile
of at least 16 rows (tl.dot's minimum) is mostly padding, and the sort is a launch of its own. The
GEMV kernels skip both: the up kernel's programs own (pair, BLOCK_N columns) and read the pair's
expert straight from topk_ids; the down kernel's programs own (token, BLOCK_N columns), walk the
token's top_k experts and write the routed sum, so y and its reduction disappear too.

Routing (`fused_route`): softmax, top-k and the optional renormalisation in one launch per step.

Block sizes per token count come from `moe_config`: a table measured by scripts/device/tune_fused_moe.py
on the GPU, keyed by (E, I, H, token bucket), else a rule of thumb.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tgi_compat.kernels.moe.configs import LaunchConfig, MoeConfig
from tgi_compat.kernels.moe.tuned import TUNED

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# The GEMV path up to this many (token, expert) pairs when no tuned config says otherwise
GEMV_MAX_PAIRS = 8
# The one-program Triton alignment up to this many pairs; a long prefill sorts with torch ops
ALIGN_KERNEL_MAX_PAIRS = 4096
_SHARED_MEMORY_BYTES = 160 * 1024  # pipelined tiles of a grouped-GEMM program (H100: 227 KB; the rest for the epilogue)


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


# --- routing --------------------------------------------------------------------------------------


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


# --- alignment ------------------------------------------------------------------------------------


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


# --- grouped GEMM ---------------------------------------------------------------------------------


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


# --- GEMV path ------------------------------------------------------------------------------------


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


# --- the block ------------------------------------------------------------------------------------


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
