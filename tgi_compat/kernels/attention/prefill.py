"""Variable-length causal extend attention: new tokens over their request's cached prefix + themselves.

Request i's new tokens are q[q_start[i] : q_start[i] + q_lens[i]] at positions kv_lens[i] - q_lens[i] + j.
Every K/V row, prefix and new alike, is read through req_to_token (the new tokens' k/v are stored
before attention runs). One program owns BLOCK_M new tokens of one request and one query head, and
walks key blocks only up to its last query's position (causal), so the cost of a cached prefix is
reading it, never recomputing it. Decode tokens (q_len 1) are a valid special case, so MIXED steps
run through this kernel too.

SLIDING_WINDOW = W (`tl.constexpr`, 0 = off): a query at position p sees keys (p - W, p], and a
program starts its key walk at its first query's window. ATTENTION_CHUNK = C (0 = off; Llama 4's local
layers): a query at position p sees keys [p // C * C, p], and a program starts its walk at its first
query's chunk. SOFTCAP = c: scores -> c * tanh(scores / c).
CAUSAL = False: every query sees all of its request's keys (a vision encoder's windows and images,
kernels/attention/varlen.py).
SPANS: each new token's bidirectional span [start, end) of positions (`token_spans`; start == end: none), whose
keys it sees besides the causal ones, past its own position and outside its window: an image's placeholders
attending to each other both ways (Gemma 3's prefill; PaliGemma's whole prompt). A program widens its key walk to
the spans of its block's queries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.attention.online_softmax import attend_kv_block


# The per-request metadata are views of one step buffer at any offset, read a scalar at a time:
# specialised on their 16-byte alignment, the kernel compiled again mid-serving (~0.7 s on an H200).
@triton.jit(do_not_specialize_on_alignment=["req_rows_ptr", "q_start_ptr", "q_lens_ptr", "kv_lens_ptr"])
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [S, KVH, D]
    v_cache_ptr,  # [S, KVH, D]
    out_ptr,  # [T, H, D]
    req_to_token_ptr,  # [R, L] int32
    req_rows_ptr,  # [B]
    q_start_ptr,  # [B]
    q_lens_ptr,  # [B]
    kv_lens_ptr,  # [B]
    span_ptr,  # [T, 2] int32 (SPANS)
    scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_rt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
    CAUSAL: tl.constexpr = True,
    ATTENTION_CHUNK: tl.constexpr = 0,
    SPANS: tl.constexpr = False,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP

    q_len = tl.load(q_lens_ptr + req).to(tl.int32)
    kv_len = tl.load(kv_lens_ptr + req).to(tl.int32)
    q_start = tl.load(q_start_ptr + req).to(tl.int64)
    prefix_len = kv_len - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this request's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m  # absolute position of each query
    token_idx = q_start + offs_m
    q = tl.load(
        q_ptr + token_idx[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    token_row_ptr = req_to_token_ptr + row * stride_rt

    head_kv = (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head, offs_d, mask_d)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = kv_len
    if CAUSAL:  # no query of this block sees past its last position
        key_end = tl.minimum(kv_len, prefix_len + (m_block + 1) * BLOCK_M)
    key_end = tl.where(m_block * BLOCK_M < q_len, key_end, 0)  # a block past q_len reads nothing
    key_begin = 0
    if SLIDING_WINDOW > 0:  # the block's first query sees nothing before its own window
        key_begin = tl.maximum(prefix_len + m_block * BLOCK_M - SLIDING_WINDOW + 1, 0)
    if ATTENTION_CHUNK > 0:  # nor before its own chunk
        key_begin = (prefix_len + m_block * BLOCK_M) // ATTENTION_CHUNK * ATTENTION_CHUNK
    if SPANS:
        span_start = tl.load(span_ptr + token_idx * 2, mask=mask_m, other=0)
        span_end = tl.load(span_ptr + token_idx * 2 + 1, mask=mask_m, other=0)
        in_some = span_end > span_start
        key_end = tl.maximum(key_end, tl.minimum(tl.max(tl.where(in_some, span_end, 0)), kv_len))
        key_begin = tl.minimum(key_begin, tl.min(tl.where(in_some, span_start, key_begin)))
    for block_start in range(key_begin, key_end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < key_end
        slots = tl.load(token_row_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        if ATTENTION_CHUNK > 0:
            visible = visible & (offs_n[None, :] >= (q_pos // ATTENTION_CHUNK * ATTENTION_CHUNK)[:, None])
        if SPANS:
            opened = (offs_n[None, :] >= span_start[:, None]) & (offs_n[None, :] < span_end[:, None])
            visible = visible | (mask_n[None, :] & mask_m[:, None] & opened)
        # rows past q_len (and, windowed, rows whose window starts past this block) see no key here
        m_i, l_i, acc = attend_kv_block(
            q, m_i, l_i, acc, slots, mask_n, visible, head_kv, scale, DOT_PRECISION, SOFTCAP, EMPTY_ROWS=True
        )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + token_idx[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,  # [S, KVH, D]
    req_to_token: torch.Tensor,  # [R, L] int32
    req_rows: torch.Tensor,  # [B]
    q_start: torch.Tensor,  # [B]
    q_lens: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B]
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,  # a query at position p sees keys (p - sliding_window, p]
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    causal: bool = True,  # False: each query sees all of its request's keys
    attention_chunk: int | None = None,  # a query at position p sees keys [p // chunk * chunk, p]
    spans: torch.Tensor | None = None,  # [T, 2] int32: each new token's bidirectional span (token_spans)
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if out is None:
        out = torch.empty_like(q)
    batch = req_rows.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    grid = (batch, num_heads, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        req_to_token,
        req_rows,
        q_start,
        q_lens,
        kv_lens,
        q if spans is None else spans,  # (never read without SPANS)
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SLIDING_WINDOW=sliding_window or 0,
        SOFTCAP=float(softcap or 0.0),
        CAUSAL=causal,
        ATTENTION_CHUNK=attention_chunk or 0,
        SPANS=spans is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,  # [S, KVH, D]
    req_to_token: torch.Tensor,  # [R, L] int32
    req_rows: torch.Tensor,  # [B]
    q_start: torch.Tensor,  # [B]
    q_lens: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attention_chunk: int | None = None,
    spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole KV (prefix + new), in fp32."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.zeros_like(q)
    for row, start, q_len, kv_len in zip(req_rows.tolist(), q_start.tolist(), q_lens.tolist(), kv_lens.tolist()):
        slots = req_to_token[row, :kv_len].long()
        k = k_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        qs = q[start : start + q_len].float()  # [Q, H, D]
        scores = torch.einsum("qhd,lhd->hql", qs, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        key_pos = torch.arange(kv_len, device=q.device)[None, :]
        hidden = key_pos > q_pos
        if sliding_window:
            hidden |= key_pos <= q_pos - sliding_window
        if attention_chunk:
            hidden |= key_pos < q_pos // attention_chunk * attention_chunk
        if spans is not None:
            span = spans[start : start + q_len].long()
            hidden &= ~((key_pos >= span[:, :1]) & (key_pos < span[:, 1:]))
        scores.masked_fill_(hidden, float("-inf"))
        out[start : start + q_len] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def token_spans(
    spans: Sequence[Sequence[tuple[int, int]]], q_lens: Sequence[int], kv_lens: Sequence[int]
) -> torch.Tensor:
    """The extend kernel's SPANS input from each request's bidirectional spans (positions [start, end), disjoint):
    [T, 2] int32 on the host, the span each of the step's new tokens lies in, or (0, 0)."""
    out = torch.zeros(sum(q_lens), 2, dtype=torch.int32)
    start = 0
    for index, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        first = kv_len - q_len  # the position of the request's first new token
        for span_start, span_end in spans[index] if index < len(spans) else ():
            lo, hi = max(span_start, first), min(span_end, kv_len)
            if lo < hi:
                out[start + lo - first : start + hi - first] = torch.tensor([span_start, span_end], dtype=torch.int32)
        start += q_len
    return out
