"""Flash-decoding over a token-granular KV cache (one new token per request, GQA-native).

Stage 1 splits each request's KV length into `num_splits` chunks (a runtime argument: one compiled
kernel serves every batch size); one program reads one chunk of one
KV head and serves every query head of that group with a [GROUP, D] x [D, BLOCK_N] tensor-core dot,
so each KV byte is read once per KV head. It writes a partial output and its log-sum-exp.
Stage 2 merges the splits of each (request, head) by log-sum-exp.

The split length is derived per request on the device (cdiv(kv_len, num_splits), at least one
block), so the grid depends only on batch size and `num_splits`: one launch shape serves every
context length, which is what CUDA-graph replay needs. Splits past a short request's end exit early.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl_for_one_request


@triton.jit
def _decode_stage1_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [S, KVH, D]
    v_cache_ptr,  # [S, KVH, D]
    req_to_token_ptr,  # [R, L] int32
    req_rows_ptr,  # [B]
    kv_lens_ptr,  # [B]
    mid_out_ptr,  # [B, H, num_splits, D] fp32
    mid_lse_ptr,  # [B, H, num_splits] fp32
    out_ptr,  # [B, H, D], written here directly when SINGLE_SPLIT (stage 2 is then skipped)
    scale,
    num_splits,  # runtime, so every batch size shares one compiled kernel
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_rt,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 so the group can be the M side of tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (bit-faithful), "tf32" otherwise (unused for bf16)
    SINGLE_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q and the newest K/V come from the previous kernels

    kv_len = tl.load(kv_lens_ptr + req).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    token_row_ptr = req_to_token_ptr + row * stride_rt

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    # Slot indices of the next block are loaded one iteration ahead, so the K/V gathers of a block
    # never wait on its own index load (measured on H200: +3.5 points of bandwidth at B=32, L=2048).
    offs_block = tl.arange(0, BLOCK_N)
    next_slots = tl.load(token_row_ptr + start + offs_block, mask=start + offs_block < end, other=0)
    for block_start in range(start, end, BLOCK_N):
        offs_n = block_start + offs_block
        mask_n = offs_n < end
        slots = next_slots.to(tl.int64)
        after = offs_n + BLOCK_N
        next_slots = tl.load(token_row_ptr + after, mask=after < end, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        v_ptrs = v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SINGLE_SPLIT:  # the whole context was this program's: the result is final (kv_len >= 1)
        out_ptrs = out_ptr + req * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        out = acc / l_i[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        # A split past a short request's end ran no iteration: it stores lse = -inf and no output.
        has_work = (offs_g * 0 + start) < end  # [GROUP_PAD], all equal; a tensor so masks broadcast
        l_safe = tl.where(has_work, l_i, 1.0)
        mid_ptrs = mid_out_ptr + req * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :]
        tl.store(mid_ptrs, acc / l_safe[:, None], mask=(mask_g & has_work)[:, None] & mask_d[None, :])
        lse = tl.where(has_work, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> ln
        tl.store(mid_lse_ptr + req * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _decode_stage2_kernel(
    mid_out_ptr,  # [B, H, num_splits, D] fp32
    mid_lse_ptr,  # [B, H, num_splits] fp32
    out_ptr,  # [B, H, D]
    num_splits,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the splits come from stage 1
        tl.extra.cuda.gdc_launch_dependents()
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + req * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))  # empty splits carry -inf -> weight 0; split 0 is never empty
    parts = tl.load(
        mid_out_ptr + req * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=(weights[:, None] > 0) & mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + req * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def choose_num_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 64) -> int:
    """About two waves of programs over the SMs; depends on the batch shape only (graph-safe).

    H200 sweep (BENCHMARKS.md, run G): four waves left a tail at small batches (B=8: 9 splits 71% of
    copy bandwidth where 4 give 78-96%), and a request at B >= 32 is best read by one program."""
    return max(1, min(max_splits, (2 * num_sms) // (batch_size * num_kv_heads)))


def choose_block_n(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """Keys per iteration: 128 while the grid is narrow (each program walks a long split), 64 once it
    is wide and splits are short (B=128 L=512: 79% with 64, 77% with 128)."""
    return 128 if batch_size * num_kv_heads < 2 * num_sms else 64


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,  # [S, KVH, D]
    req_to_token: torch.Tensor,  # [R, L] int32
    req_rows: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B]
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [B, H, D]
    mid_out: torch.Tensor | None = None,  # [>=B, H, >=num_splits, D] fp32 scratch
    mid_lse: torch.Tensor | None = None,  # [>=B, H, >=num_splits] fp32 scratch
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if mid_out is None:
        mid_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    pdl = use_pdl_for_one_request(q, batch)
    _decode_stage1_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, req_to_token, req_rows, kv_lens, mid_out, mid_lse, out,
        scale, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        SINGLE_SPLIT=num_splits == 1,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    if num_splits == 1:
        return out
    _decode_stage2_kernel[(batch, num_heads)](
        mid_out, mid_lse, out, num_splits,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        USE_PDL=pdl,
        num_warps=4 if block_d >= 128 else 2,
        **launch_options(pdl),
    )
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,  # [S, KVH, D]
    req_to_token: torch.Tensor,  # [R, L] int32
    req_rows: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    """Each request's single query attends to all of its kv_len tokens, read through req_to_token."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for i, (row, kv_len) in enumerate(zip(req_rows.tolist(), kv_lens.tolist())):
        slots = req_to_token[row, :kv_len].long()
        k = k_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
