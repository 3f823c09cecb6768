"""One step of the online softmax over a block of keys read through their KV slots: the inner loop body that the
decode and the extend (prefill) kernels share.

A program's KV head travels as one tuple, `head_kv` = (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs,
stride_vh, kv_head, offs_d, mask_d) (both caches [S, KVH, D], D contiguous; offs_d/mask_d: the head dimension's
block): a kernel builds it once (Triton flattens tuples and inlines the helpers, so the generated code is that of
separate arguments).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(scores, SOFTCAP: tl.constexpr):
    """SOFTCAP * tanh(scores / SOFTCAP), with tanh from the sigmoid (portable, interpreter included)."""
    return SOFTCAP * (2.0 * tl.sigmoid(scores * (2.0 / SOFTCAP)) - 1.0)


@triton.jit
def attend_kv_block(
    q,  # [M, BLOCK_D] queries of one KV head's group (decode) or of one head's token block (extend)
    m_i,  # [M] running max of the scores, log2 domain
    l_i,  # [M] running sum of exp2(score - m_i)
    acc,  # [M, BLOCK_D] fp32 running output, unnormalised
    slots,  # [BLOCK_N] int64: the KV slots of this block's keys
    mask_n,  # [BLOCK_N]: keys that exist
    visible,  # [M or 1, BLOCK_N]: which key each query sees (mask_n and the caller's causal/window rule)
    head_kv,
    scale,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EMPTY_ROWS: tl.constexpr,  # a query row may see no key of a block: keep its max finite (no inf - inf)
):
    """One step of the online softmax over a block of BLOCK_N keys read through their slots:
    gathers K and V, scores (soft-capped when SOFTCAP > 0), masks, and returns (m_i, l_i, acc) updated."""
    k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head, offs_d, mask_d = head_kv
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k_ptrs = k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
    # an FP8 cache (unit scale) widens to the model's dtype here; for a bf16/fp16 cache this is a no-op
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    if SOFTCAP > 0:
        qk = soft_cap(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale, SOFTCAP) * 1.4426950408889634
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale * 1.4426950408889634)  # [M, BLOCK_N]
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = m_new
    if EMPTY_ROWS:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
