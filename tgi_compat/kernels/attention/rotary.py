"""Rotary position embedding, rotate-half ("neox") layout, applied in place to q and k.

cos/sin are [P, D/2] tables (any scaling, e.g. Llama-3's, is already folded into them by the
model). With `positions` the kernel gathers row positions[t] for token t; without, row t (tables
already gathered for this step). The math runs in fp32 with one rounding per output element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.pdl import launch_options, use_pdl_for_one_request


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_t,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotates heads [0, NUM_HEADS) of one token in place; returns the rotated halves (x's dtype)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _store_token_kv(
    k1,
    k2,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    token,
    stride_vt,
    stride_vh,
    stride_cks,
    stride_ckh,
    stride_cvs,
    stride_cvh,
    FIRST_K_HEAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Writes one token's rotated k (rows FIRST_K_HEAD.. of the rotated block) and its v to its slot."""
    slot = tl.load(slots_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = (offs_d < HALF)[None, :]
    is_k = ((offs_h >= FIRST_K_HEAD) & (offs_h < NUM_HEADS))[:, None] & mask_d
    k_dst = k_cache_ptr + slot * stride_cks + (offs_h - FIRST_K_HEAD)[:, None] * stride_ckh + offs_d[None, :]
    tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    is_v = (offs_h < NUM_KV_HEADS)[:, None] & mask_d
    v_src = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_cvs + offs_h[:, None] * stride_cvh + offs_d[None, :]
    v1 = tl.load(v_src, mask=is_v, other=0.0)
    v2 = tl.load(v_src + HALF, mask=is_v, other=0.0)
    tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=is_v)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    cos_ptr,  # [P, D/2]
    sin_ptr,  # [P, D/2]
    positions_ptr,  # [T]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    # STORE_KV: q's block holds q|k heads; heads FIRST_K_HEAD.. are k, written with v to the KV cache
    v_ptr=None,
    k_cache_ptr=None,
    v_cache_ptr=None,
    slots_ptr=None,
    stride_vt=0,
    stride_vh=0,
    stride_cks=0,
    stride_ckh=0,
    stride_cvs=0,
    stride_cvh=0,
    STORE_KV: tl.constexpr = False,
    FIRST_K_HEAD: tl.constexpr = 0,
    NUM_KV_HEADS: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,  # launched as a programmatic dependent (tgi_compat/kernels/pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q|k|v are the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()  # one small wave: let attention get ready
    token = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + token).to(tl.int64)
    else:
        row = token
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_ptr + row * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sin + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    q1, q2 = _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    if STORE_KV:
        _store_token_kv(
            q1,
            q2,
            v_ptr,
            k_cache_ptr,
            v_cache_ptr,
            slots_ptr,
            token,
            stride_vt,
            stride_vh,
            stride_cks,
            stride_ckh,
            stride_cvs,
            stride_cvh,
            FIRST_K_HEAD,
            NUM_Q_HEADS,
            NUM_KV_HEADS,
            HALF,
            BLOCK_QH,
            BLOCK_HALF,
        )
    if HAS_K:
        _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor | None,  # [T, KVH, D], rotated in place
    cos: torch.Tensor,  # [P, D/2]
    sin: torch.Tensor,  # [P, D/2]
    positions: torch.Tensor | None = None,  # [T]; None: row t of cos/sin belongs to token t
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    half = cos.shape[-1]
    assert 2 * half == head_dim and q.stride(2) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert k is None or k.stride(2) == 1
    if num_tokens == 0:
        return
    k_arg = k if k is not None else q
    _rotary_kernel[(num_tokens,)](
        q,
        k_arg,
        cos,
        sin,
        positions if positions is not None else cos,
        q.stride(0),
        q.stride(1),
        k_arg.stride(0),
        k_arg.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_K_HEADS=k_arg.shape[1],
        HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_heads),
        BLOCK_KH=triton.next_power_of_2(k_arg.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        HAS_K=k is not None,
        HAS_POSITIONS=positions is not None,
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
    )


def rotary_and_kv_store(
    qk: torch.Tensor,  # [T, H + KVH, D]: q then k heads (a view of the fused qkv output), rotated in place
    v: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [T, D/2], this step's rows
    sin: torch.Tensor,  # [T, D/2]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,  # [S, KVH, D]
    slots: torch.Tensor,  # [T]
    num_q_heads: int,
) -> None:
    """Rotary on q and k, then k and v into their KV slots: tgi_compat.kernels.attention.kv_store fused into the rotary pass."""
    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    half = cos.shape[-1]
    assert 2 * half == head_dim and num_heads == num_q_heads + num_kv_heads
    assert qk.stride(2) == 1 and v.stride(2) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if num_tokens == 0:
        return
    pdl = use_pdl_for_one_request(qk, num_tokens)
    _rotary_kernel[(num_tokens,)](
        qk,
        qk,
        cos,
        sin,
        cos,
        qk.stride(0),
        qk.stride(1),
        qk.stride(0),
        qk.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_K_HEADS=num_heads,
        HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_heads),
        BLOCK_KH=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        HAS_K=False,
        HAS_POSITIONS=False,
        v_ptr=v,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slots_ptr=slots,
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_cks=k_cache.stride(0),
        stride_ckh=k_cache.stride(1),
        stride_cvs=v_cache.stride(0),
        stride_cvh=v_cache.stride(1),
        STORE_KV=True,
        FIRST_K_HEAD=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        USE_PDL=pdl,
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
        **launch_options(pdl),
    )


def rotary_embedding_ref(
    x: torch.Tensor,  # [T, N, D]
    cos: torch.Tensor,  # [P, D/2]
    sin: torch.Tensor,  # [P, D/2]
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns x rotated (rotate-half layout), computed in fp32 and rounded once."""
    if positions is not None:
        cos, sin = cos[positions.long()], sin[positions.long()]
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]  # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
