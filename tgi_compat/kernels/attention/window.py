"""Non-causal attention over short packed sequences (a vision encoder's windows: Qwen2.5-VL's are 64 patches), with
the rotate-half rope applied to q and k as they are loaded.

Each program holds one sequence of one head whole, so there is no online softmax and no K/V loop: one QK^T tile, one
softmax, one PV tile. q, k and v are read once from the fused qkv projection's output and never written back rotated:
where the generic path runs the rotary kernel (a read and a write of q and k) and then FlashAttention's varlen kernel,
whose 128-row tiles are half empty on 64-token windows, this is one pass over qkv and one write of the output.

The numbers are the two-kernel path's: rope in fp32 rounded once to the input dtype, QK^T and PV accumulated in fp32
with P rounded to the input dtype before PV, and the softmax's sum taken from the unrounded P (FlashAttention's order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.attention.decode import dot_precision

WINDOW_TOKENS = 128  # the longest sequence a program holds whole (its QK^T tile is this square, in fp32 registers)


@triton.jit
def _rotated(x1, x2, cos, sin, ROTARY: tl.constexpr):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) in fp32, rounded once to x's dtype."""
    if ROTARY:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)
    return x1, x2


@triton.jit
def _window_attention_kernel(
    qkv_ptr,  # [T, 3, H, D]: q, k, v of each token
    cos_ptr,  # [T, D / 2] fp32: each token's rope angles (one half; the rope repeats them over both halves)
    sin_ptr,
    cu_seqlens_ptr,  # [B + 1] int32
    out_ptr,  # [T, H, D]
    stride_t,
    stride_part,
    stride_h,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    qk_scale,  # the softmax scale times log2(e): exp2 below
    HALF: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROTARY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: tf32 would round them
):
    seq = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - start
    offs_l = tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_l = offs_l < length
    mask = mask_l[:, None] & (offs_d < HALF)[None, :]
    rows = start + offs_l

    first = qkv_ptr + rows[:, None] * stride_t + head * stride_h + offs_d[None, :]  # each head's first half
    q1 = tl.load(first, mask=mask, other=0.0)
    q2 = tl.load(first + HALF, mask=mask, other=0.0)
    k1 = tl.load(first + stride_part, mask=mask, other=0.0)
    k2 = tl.load(first + stride_part + HALF, mask=mask, other=0.0)
    cos = tl.zeros((BLOCK_L, BLOCK_HALF), tl.float32)
    sin = tl.zeros((BLOCK_L, BLOCK_HALF), tl.float32)
    if ROTARY:
        cos = tl.load(cos_ptr + rows[:, None] * stride_cos + offs_d[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + rows[:, None] * stride_sin + offs_d[None, :], mask=mask, other=0.0)
    q1, q2 = _rotated(q1, q2, cos, sin, ROTARY)
    k1, k2 = _rotated(k1, k2, cos, sin, ROTARY)

    # the head dim in two halves (the rope's), each padded to a power of two with zeros that add nothing
    scores = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    scores += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
    scores = tl.where(mask_l[None, :], scores * qk_scale, float("-inf"))
    p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
    total = tl.sum(p, axis=1)[:, None]
    p = p.to(q1.dtype)

    v1 = tl.load(first + 2 * stride_part, mask=mask, other=0.0)
    v2 = tl.load(first + 2 * stride_part + HALF, mask=mask, other=0.0)
    out = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    o1 = tl.dot(p, v1, input_precision=DOT_PRECISION) / total
    o2 = tl.dot(p, v2, input_precision=DOT_PRECISION) / total
    tl.store(out, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


def window_attention(
    qkv: torch.Tensor,  # [T, 3, H, D]: the fused projection's output, viewed (head dim contiguous)
    cu_seqlens: torch.Tensor,  # [B + 1] int32, on qkv's device
    longest: int,  # the longest sequence, at most WINDOW_TOKENS
    scale: float,
    cos: torch.Tensor | None = None,  # [T, D / 2] fp32: rotate q and k by these first; None: no rope
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's tokens attend to all of that sequence's (q and k roped on load) -> [T, H, D]."""
    tokens, parts, heads, head_dim = qkv.shape
    assert parts == 3 and head_dim % 2 == 0 and qkv.stride(3) == 1 and 0 < longest <= WINDOW_TOKENS
    if cos is not None:
        assert sin is not None and cos.shape == sin.shape == (tokens, head_dim // 2)
        assert cos.stride(1) == 1 and sin.stride(1) == 1
        tables = (cos, sin)
    else:
        tables = (qkv, qkv)  # (unread without the rope)
    out = qkv.new_empty(tokens, heads, head_dim)
    if tokens == 0:
        return out
    half = head_dim // 2
    _window_attention_kernel[(cu_seqlens.shape[0] - 1, heads)](
        qkv,
        *tables,
        cu_seqlens,
        out,
        qkv.stride(0),
        qkv.stride(1),
        qkv.stride(2),
        out.stride(0),
        out.stride(1),
        tables[0].stride(0),
        tables[1].stride(0),
        scale * 1.4426950408889634,
        HALF=half,
        BLOCK_L=max(16, triton.next_power_of_2(longest)),
        BLOCK_HALF=max(16, triton.next_power_of_2(half)),
        ROTARY=cos is not None,
        DOT_PRECISION=dot_precision(qkv.dtype),
        num_warps=4,
    )
    return out
