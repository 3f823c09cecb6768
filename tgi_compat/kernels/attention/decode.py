"""Flash-decoding over a token-granular KV cache (one new token per request, GQA-native).

Stage 1 splits each request's KV length into `num_splits` chunks (a runtime argument: one compiled
kernel serves every batch size); one program reads one chunk of one
KV head and serves every query head of that group with a [GROUP, D] x [D, BLOCK_N] tensor-core dot,
so each KV byte is read once per KV head. It writes a partial output and its log-sum-exp.
Stage 2 merges the splits of each (request, head) by log-sum-exp, as its own kernel or, given a
`split_counter`, inside stage 1 (tgi_compat/kernels/attention/decode_merge.py). Given a `NewTokenKV`, stage 1
also rotates q and stores the step's k and v (tgi_compat/kernels/attention/decode_rotary.py).

The split length is derived per request on the device (cdiv(kv_len, num_splits), at least one
block), so the grid depends only on batch size and `num_splits`: one launch shape serves every
context length, which is what CUDA-graph replay needs. Splits past a short request's end exit early.

Model switches, both `tl.constexpr` (0 = off) so the plain path compiles as before:
SLIDING_WINDOW = W: the query (position kv_len - 1) sees only the last W keys; the splits divide
those W keys, so a windowed layer reads W keys whatever the context. ATTENTION_CHUNK = C: the query sees
the keys of its own chunk, [(kv_len - 1) // C * C, kv_len) (Llama 4's local layers), split the same way. SOFTCAP = c: scores become
c * tanh(scores / c) before the softmax (Gemma 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.attention.decode_merge import (
    RUNTIME_SPLIT_ARGS,
    launch_stage2,
    merge_chunk,
    merge_splits,
    split_outputs,
)
from tgi_compat.kernels.attention.decode_rotary import NewTokenKV, new_token_args, rotated_query
from tgi_compat.kernels.attention.online_softmax import attend_kv_block
from tgi_compat.kernels.pdl import launch_options, use_pdl_for_one_request


@triton.jit
def _attend_split(
    q,
    scale,
    token_row_ptr,
    start,
    end,
    head_kv,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The online softmax of the query group over the split's keys [start, end): (m_i, l_i, acc)."""
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
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
        # the one query sees every key of its split (the window is in the split bounds)
        visible = mask_n[None, :]
        m_i, l_i, acc = attend_kv_block(
            q, m_i, l_i, acc, slots, mask_n, visible, head_kv, scale, DOT_PRECISION, SOFTCAP, EMPTY_ROWS=False
        )
    return m_i, l_i, acc


@triton.jit
def _store_partial(m_i, l_i, acc, partials, req, split, heads, offs_g, mask_g, offs_d, mask_d, start, end):
    """The split's normalised output and its log-sum-exp, for the merge. A split past a short request's end ran
    no iteration: it stores lse = -inf and no output."""
    mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh = partials
    has_work = (offs_g * 0 + start) < end  # [GROUP_PAD], all equal; a tensor so masks broadcast
    l_safe = tl.where(has_work, l_i, 1.0)
    mid_ptrs = mid_out_ptr + req * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :]
    tl.store(mid_ptrs, acc / l_safe[:, None], mask=(mask_g & has_work)[:, None] & mask_d[None, :])
    lse = tl.where(has_work, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> ln
    tl.store(mid_lse_ptr + req * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit(
    do_not_specialize=RUNTIME_SPLIT_ARGS,
    do_not_specialize_on_alignment=[*RUNTIME_SPLIT_ARGS, "req_rows_ptr", "kv_lens_ptr", "counter_ptr", "slots_ptr"],
)
def _decode_stage1_kernel(
    q_ptr,  # [B, H, D] (unrotated when ROTARY)
    k_cache_ptr,  # [S, KVH, D]
    v_cache_ptr,  # [S, KVH, D]
    req_to_token_ptr,  # [R, L] int32
    req_rows_ptr,  # [B]
    kv_lens_ptr,  # [B]
    mid_out_ptr,  # [B, H, num_splits, D] fp32
    mid_lse_ptr,  # [B, H, num_splits] fp32
    out_ptr,  # [B, H, D], written here directly when SINGLE_SPLIT (stage 2 is then skipped) or by the merge
    counter_ptr,  # [B, KVH] int32, zero between launches (MERGE only)
    new_k_ptr,
    new_v_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,  # NewTokenKV's tensors (ROTARY only)
    scale,
    num_splits,  # runtime, so every batch size shares one compiled kernel
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    stride_cos,
    stride_sin,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 so the group can be the M side of tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (bit-faithful), "tf32" otherwise (unused for bf16)
    SINGLE_SPLIT: tl.constexpr,
    MERGE: tl.constexpr,  # the last program of each (request, KV head) merges the splits (no stage 2)
    MERGE_G: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    ROTARY: tl.constexpr,  # rotate q here; the newest token's k/v are rotated and stored here
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (tgi_compat/kernels/pdl.py)
    SLIDING_WINDOW: tl.constexpr = 0,  # > 0: only the last SLIDING_WINDOW keys are visible
    SOFTCAP: tl.constexpr = 0.0,  # > 0: scores -> SOFTCAP * tanh(scores / SOFTCAP)
    ATTENTION_CHUNK: tl.constexpr = 0,  # > 0: only the keys of the query's own chunk are visible
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q and the newest K/V come from the previous kernels

    # the split's keys: [start, end) of the visible [kv_begin, kv_len), whole blocks a split
    kv_len = tl.load(kv_lens_ptr + req).to(tl.int32)
    kv_begin = 0
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(kv_len - SLIDING_WINDOW, 0)
    if ATTENTION_CHUNK > 0:
        kv_begin = (kv_len - 1) // ATTENTION_CHUNK * ATTENTION_CHUNK
    split_len = tl.cdiv(tl.cdiv(kv_len - kv_begin, num_splits), BLOCK_N) * BLOCK_N
    start = kv_begin + split * split_len
    end = tl.minimum(start + split_len, kv_len)

    # the query heads of this KV head's group, padded to GROUP_PAD rows for tl.dot
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q_rows = req * stride_qb + heads * stride_qh
    head_kv = (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head, offs_d, mask_d)
    if ROTARY:
        new_kv = (new_k_ptr, new_v_ptr, slots_ptr, stride_nkb, stride_nkh, stride_nvb, stride_nvh)
        rope = (cos_ptr, sin_ptr, stride_cos, stride_sin)
        q = rotated_query(q_ptr, q_rows, mask_g, req, kv_len, start, end, head_kv, new_kv, rope, HEAD_DIM)
    else:
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    qk_scale = scale
    if k_cache_ptr.dtype.element_ty.is_fp8() and q_ptr.dtype.element_ty != tl.float32:
        # FP8 keys and values widen exactly to fp16 in one conversion per two elements (to bf16 it takes
        # three steps, which bound this kernel), so a half-precision model's FP8 cache runs its dots in
        # fp16. q goes over with the softmax scale applied (fp16 keeps more of a bf16 q's mantissa; the
        # scale keeps it in range).
        q = (q.to(tl.float32) * scale).to(tl.float16)
        qk_scale = 1.0
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    token_row_ptr = req_to_token_ptr + row * stride_rt

    m_i, l_i, acc = _attend_split(
        q, qk_scale, token_row_ptr, start, end, head_kv, DOT_PRECISION, SOFTCAP, GROUP_PAD, BLOCK_D, BLOCK_N
    )
    if USE_PDL:
        if not MERGE:
            tl.extra.cuda.gdc_launch_dependents()
    if SINGLE_SPLIT:  # the whole context was this program's: the result is final (kv_len >= 1)
        out_ptrs = out_ptr + req * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        out = acc / l_i[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        partials = (mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh)
        _store_partial(m_i, l_i, acc, partials, req, split, heads, offs_g, mask_g, offs_d, mask_d, start, end)
        if MERGE:
            if start < end:  # the splits with work take tickets; the last one merges
                tl.debug_barrier()  # every thread's partial stores precede the ticket (released with it)
                counter = counter_ptr + req * stride_cb + kv_head
                ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                num_work = tl.cdiv(kv_len - kv_begin, split_len)
                if ticket == num_work - 1:
                    output = (out_ptr, stride_ob, stride_oh)
                    merge_splits(
                        partials, output, req, kv_head, num_work, GROUP, HEAD_DIM, BLOCK_D, MERGE_G, MERGE_CHUNK
                    )
                    tl.store(counter, 0)  # every ticket is drawn: clean for the next launch or graph replay
    if USE_PDL:
        # Merged: the next kernel may start only once the merge is done. Triggered after the KV loop
        # instead, the batch-1 step ran 60 us slower (H200, Llama-3-8B; likely the o_proj GEMV's early
        # weight reads delaying the ticket and the merge's reads).
        if MERGE:
            tl.extra.cuda.gdc_launch_dependents()


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
    q: torch.Tensor,  # [B, H, D]; unrotated when new_token is given
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
    split_counter: torch.Tensor | None = None,  # [>=B, KVH] int32, all zero: merge in stage 1 (left zero)
    new_token: NewTokenKV | None = None,  # rotary + KV store of the step's token, fused in
    sliding_window: int | None = None,  # only the last `sliding_window` keys are visible
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    attention_chunk: int | None = None,  # only the keys of the query's own chunk are visible
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    group = num_heads // num_kv_heads
    out, mid_out, mid_lse = split_outputs(q, num_splits, out, mid_out, mid_lse)
    if batch == 0:
        return out
    counter = kv_lens  # never read unless MERGE
    if split_counter is not None and num_splits > 1:
        assert split_counter.dtype == torch.int32 and split_counter.shape[0] >= batch
        assert split_counter.shape[1] == num_kv_heads
        counter = split_counter
    merge = counter is split_counter
    new_tensors, new_strides = new_token_args(new_token, q, num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    merge_g = triton.next_power_of_2(group)
    pdl = use_pdl_for_one_request(q, batch)
    _decode_stage1_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_rows,
        kv_lens,
        mid_out,
        mid_lse,
        out,
        counter,
        *new_tensors,
        scale,
        num_splits,
        *q.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        req_to_token.stride(0),
        *mid_out.stride()[:3],
        *mid_lse.stride()[:2],
        *out.stride()[:2],
        counter.stride(0),
        *new_strides,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        SINGLE_SPLIT=num_splits == 1,
        MERGE=merge,
        MERGE_G=merge_g,
        MERGE_CHUNK=merge_chunk(merge_g, block_d),
        ROTARY=new_token is not None,
        USE_PDL=pdl,
        SLIDING_WINDOW=sliding_window or 0,
        SOFTCAP=float(softcap or 0.0),
        ATTENTION_CHUNK=attention_chunk or 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    if num_splits > 1 and not merge:
        launch_stage2(mid_out, mid_lse, out, num_splits, pdl)
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,  # [S, KVH, D]
    req_to_token: torch.Tensor,  # [R, L] int32
    req_rows: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Each request's single query attends to its kv_len tokens (the last `sliding_window` of them, or those
    of its own `attention_chunk`, when given), read through req_to_token."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for i, (row, kv_len) in enumerate(zip(req_rows.tolist(), kv_lens.tolist())):
        begin = max(0, kv_len - sliding_window) if sliding_window else 0
        if attention_chunk:
            begin = (kv_len - 1) // attention_chunk * attention_chunk
        slots = req_to_token[row, begin:kv_len].long()
        k = k_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
