"""Rotary embedding and the KV store of the step's token, fused into flash-decoding's stage 1 (a `NewTokenKV`
given to `decode_attention`): q arrives unrotated and each program rotates its query group in registers; the
program whose split holds the request's newest position also rotates that token's k and writes it and v into the
KV cache before its own reads. The separate rotary + KV-store kernel then has nothing left to do.

`NewTokenKV`'s tensors and strides travel as two tuples: `new_kv` = (new_k_ptr, new_v_ptr, slots_ptr, stride_nkb,
stride_nkh, stride_nvb, stride_nvh) and `rope` = (cos_ptr, sin_ptr, stride_cos, stride_sin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class NewTokenKV:
    """This step's token of each request, for the fused rotary path: unrotated k, v and the rope rows."""

    k: torch.Tensor  # [B, KVH, D], unrotated (a view of the fused qkv output)
    v: torch.Tensor  # [B, KVH, D]
    cos: torch.Tensor  # [B, D/2], this step's rows
    sin: torch.Tensor  # [B, D/2]
    slots: torch.Tensor  # [B], the KV slot of each request's newest position


def new_token_args(
    new_token: NewTokenKV | None, q: torch.Tensor, num_kv_heads: int
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """Stage 1's NewTokenKV tensors and strides (placeholders that are never read without one)."""
    if new_token is None:
        return (q,) * 5, (0,) * 6
    k, v, cos, sin = new_token.k, new_token.v, new_token.cos, new_token.sin
    batch, _, head_dim = q.shape
    assert k.shape == v.shape == (batch, num_kv_heads, head_dim) and k.stride(2) == 1 and v.stride(2) == 1
    assert cos.shape == sin.shape == (batch, head_dim // 2) and cos.stride(1) == 1 and sin.stride(1) == 1
    assert head_dim % 2 == 0 and new_token.slots.shape == (batch,)
    tensors = (k, v, cos, sin, new_token.slots)
    return tensors, (*k.stride()[:2], *v.stride()[:2], cos.stride(0), sin.stride(0))


@triton.jit
def _rotate_rows(ptr, row_offsets, mask_rows, cos, sin, offs_d, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows of head vectors at ptr + row_offsets, rotated in fp32 (rotate-half layout): [ROWS, BLOCK_D].
    cos/sin are [BLOCK_D]: entry d holds the table's entry d mod HALF."""
    first_half = offs_d < HALF
    partner = tl.where(first_half, offs_d + HALF, offs_d - HALF)
    mask = mask_rows[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(ptr + row_offsets[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    pair = tl.load(ptr + row_offsets[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x * cos[None, :] + pair * tl.where(first_half, -sin, sin)[None, :]


@triton.jit
def _store_new_token_kv(new_k_ptr, new_v_ptr, head_kv, slot, cos, sin, stride_kh, stride_vh, HEAD_DIM: tl.constexpr):
    """Rotates one request's new k of this KV head; writes it and its v into the token's KV slot.
    new_k_ptr / new_v_ptr point at the request's row; stride_kh / stride_vh are their head strides."""
    k_cache_ptr, v_cache_ptr, stride_ks, stride_ckh, stride_vs, stride_cvh, kv_head, offs_d, mask_d = head_kv
    one_row = tl.arange(0, 1)  # row offset 0: [1, BLOCK_D] tiles
    mask = (offs_d < HEAD_DIM)[None, :]
    k = _rotate_rows(new_k_ptr + kv_head * stride_kh, one_row, one_row == 0, cos, sin, offs_d, HEAD_DIM // 2, HEAD_DIM)
    v = tl.load(new_v_ptr + kv_head * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_ks + kv_head * stride_ckh + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vs + kv_head * stride_cvh + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotated_query(q_ptr, q_rows, mask_g, req, kv_len, start, end, head_kv, new_kv, rope, HEAD_DIM: tl.constexpr):
    """The program's query group [GROUP_PAD, BLOCK_D], rotated (q_ptr's dtype). The program whose split [start,
    end) holds the request's newest position also stores that token's rotated k and its v, before its own gathers
    read their slot."""
    k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head, offs_d, mask_d = head_kv
    new_k_ptr, new_v_ptr, slots_ptr, stride_nkb, stride_nkh, stride_nvb, stride_nvh = new_kv
    cos_ptr, sin_ptr, stride_cos, stride_sin = rope
    offs_half = offs_d % (HEAD_DIM // 2)
    cos = tl.load(cos_ptr + req * stride_cos + offs_half, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + req * stride_sin + offs_half, mask=mask_d, other=0.0).to(tl.float32)
    q = _rotate_rows(q_ptr, q_rows, mask_g, cos, sin, offs_d, HEAD_DIM // 2, HEAD_DIM).to(q_ptr.dtype.element_ty)
    if (start < end) & (end == kv_len):  # this split holds the newest position
        slot = tl.load(slots_ptr + req).to(tl.int64)
        new_k, new_v = new_k_ptr + req * stride_nkb, new_v_ptr + req * stride_nvb
        _store_new_token_kv(new_k, new_v, head_kv, slot, cos, sin, stride_nkh, stride_nvh, HEAD_DIM)
        tl.debug_barrier()  # every thread's cache stores precede this program's gathers of that slot
    return q
