"""Rotary position embedding, rotate-half ("neox") layout, applied in place to q and k.

cos/sin are [P, D/2] tables (any scaling, e.g. Llama-3's, is already folded into them by the
model). With `positions` the kernel gathers row positions[t] for token t; without, row t (tables
already gathered for this step). The math runs in fp32 with one rounding per output element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    cos_ptr,  # [P, D/2]
    sin_ptr,  # [P, D/2]
    positions_ptr,  # [T]
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + token).to(tl.int64)
    else:
        row = token
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_ptr + row * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sin + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
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
        q, k_arg, cos, sin, positions if positions is not None else cos,
        q.stride(0), q.stride(1),
        k_arg.stride(0), k_arg.stride(1),
        cos.stride(0), sin.stride(0),
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
