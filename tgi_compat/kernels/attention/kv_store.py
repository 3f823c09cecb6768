"""Scatter the new tokens' k/v rows into their KV-cache slots (token-granular cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    k_ptr,  # [T, KVH, D] (token stride free, head/dim contiguous: a view into a fused qkv output works)
    v_ptr,  # [T, KVH, D]
    k_cache_ptr,  # [S, KVH, D]
    v_cache_ptr,  # [S, KVH, D]
    slots_ptr,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cks,
    stride_ckh,
    stride_cvs,
    stride_cvh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_cks + offs_h[:, None] * stride_ckh + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_cvs + offs_h[:, None] * stride_cvh + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_store(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,  # [S, KVH, D]
    slots: torch.Tensor,  # [T]
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if num_tokens == 0:
        return
    _kv_store_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def kv_store_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    k_cache[slots.long()] = k.to(k_cache.dtype)
    v_cache[slots.long()] = v.to(v_cache.dtype)
