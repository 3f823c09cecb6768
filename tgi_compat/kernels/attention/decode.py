"""Flash-decoding over a token-granular KV cache (one new token per request, GQA-native).

Stage 1 splits each request's KV length into `num_splits` chunks (a runtime argument: one compiled
kernel serves every batch size); one program reads one chunk of one
KV head and serves every query head of that group with a [GROUP, D] x [D, BLOCK_N] tensor-core dot,
so each KV byte is read once per KV head. It writes a partial output and its log-sum-exp.
Stage 2 merges the splits of each (request, head) by log-sum-exp.

Merged stage 2 (a `split_counter` is given): each program with work takes a ticket from a
per-(request, KV head) counter once its partial is stored; the one that draws the last ticket merges
that KV head's partials into `out` and resets the counter for the next launch. One launch instead of
two, which pays where a decode step is a chain of few-microsecond kernels (small batches).

Fused rotary (a `NewTokenKV` is given): q arrives unrotated and each program rotates its query
group in registers; the program whose split holds the request's newest position also rotates that
token's k and writes it and v into the KV cache before its own reads. The separate rotary + KV-store
kernel then has nothing left to do.

The split length is derived per request on the device (cdiv(kv_len, num_splits), at least one
block), so the grid depends only on batch size and `num_splits`: one launch shape serves every
context length, which is what CUDA-graph replay needs. Splits past a short request's end exit early.

Model switches, both `tl.constexpr` (0 = off) so the plain path compiles as before:
SLIDING_WINDOW = W: the query (position kv_len - 1) sees only the last W keys; the splits divide
those W keys, so a windowed layer reads W keys whatever the context. SOFTCAP = c: scores become
c * tanh(scores / c) before the softmax (Gemma 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.pdl import launch_options, use_pdl_for_one_request


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
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    offs_d,
    mask_d,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    scale,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EMPTY_ROWS: tl.constexpr,  # a query row may see no key of a block: keep its max finite (no inf - inf)
):
    """One step of the online softmax over a block of BLOCK_N keys read through their slots:
    gathers K and V, scores (soft-capped when SOFTCAP > 0), masks, and returns (m_i, l_i, acc) updated.
    Shared by the decode and extend kernels; Triton inlines it."""
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


@dataclass
class NewTokenKV:
    """This step's token of each request, for the fused rotary path: unrotated k, v and the rope rows."""

    k: torch.Tensor  # [B, KVH, D], unrotated (a view of the fused qkv output)
    v: torch.Tensor  # [B, KVH, D]
    cos: torch.Tensor  # [B, D/2], this step's rows
    sin: torch.Tensor  # [B, D/2]
    slots: torch.Tensor  # [B], the KV slot of each request's newest position


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
def _store_new_token_kv(
    new_k_ptr,
    new_v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot,
    kv_head,
    cos,
    sin,
    offs_d,
    stride_kh,
    stride_vh,
    stride_ks,
    stride_ckh,
    stride_vs,
    stride_cvh,
    HEAD_DIM: tl.constexpr,
):
    """Rotates one request's new k of this KV head; writes it and its v into the token's KV slot.
    new_k_ptr / new_v_ptr point at the request's row."""
    one_row = tl.arange(0, 1)  # row offset 0: [1, BLOCK_D] tiles
    mask = (offs_d < HEAD_DIM)[None, :]
    k = _rotate_rows(new_k_ptr + kv_head * stride_kh, one_row, one_row == 0, cos, sin, offs_d, HEAD_DIM // 2, HEAD_DIM)
    v = tl.load(new_v_ptr + kv_head * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_ks + kv_head * stride_ckh + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vs + kv_head * stride_cvh + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_splits(
    mid_out_ptr,
    mid_lse_ptr,
    out_ptr,
    req,
    kv_head,
    num_work,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_G: tl.constexpr,  # GROUP rounded up to a power of two
    MERGE_CHUNK: tl.constexpr,  # splits per iteration
):
    """Log-sum-exp merge of splits [0, num_work) of one KV head's query heads into out. The partials
    come from other programs of this launch: read at L2 (.cg), never from a possibly stale L1 line."""
    offs_g = tl.arange(0, MERGE_G)
    offs_c = tl.arange(0, MERGE_CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    lse_rows = mid_lse_ptr + req * stride_lb + heads[:, None] * stride_lh  # [G, 1]
    part_rows = mid_out_ptr + req * stride_mb + heads[:, None, None] * stride_mh + offs_d[None, None, :]  # [G, 1, D]
    m = tl.full([MERGE_G], float("-inf"), tl.float32)
    total = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], tl.float32)
    for first in range(0, num_work, MERGE_CHUNK):
        splits = first + offs_c
        mask = mask_g[:, None] & (splits < num_work)[None, :]  # [G, C]
        lse = tl.load(lse_rows + splits[None, :], mask=mask, other=float("-inf"), cache_modifier=".cg")
        lse = tl.where(mask_g[:, None], lse, 0.0)  # padding heads: finite, so no NaN (never stored)
        m_new = tl.maximum(m, tl.max(lse, 1))  # finite: split 0 always has work
        weights = tl.exp(lse - m_new[:, None])  # [G, C]
        parts = tl.load(
            part_rows + splits[None, :, None] * stride_ms,
            mask=mask[:, :, None] & mask_d[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [G, C, D]
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None] + tl.sum(parts * weights[:, :, None], 1)
        total = total * alpha + tl.sum(weights, 1)
        m = m_new
    out = acc / total[:, None]
    out_ptrs = out_ptr + req * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


# A step's split count (and so the partial LSEs' strides) follows its batch size, and in an eager mixed
# step its metadata tensors are views at any offset (the ticket counter is kv_lens when unused):
# specialised on them (== 1, divisible by 16, 16-byte aligned), the kernel compiled again mid-serving
# whenever a new combination came (~1 s on an H200, every running request stalled). They are loop
# bounds, scalar offsets and scalar loads: nothing to gain.
_RUNTIME_SPLIT_ARGS = ["num_splits", "stride_lb", "stride_lh"]


@triton.jit(
    do_not_specialize=_RUNTIME_SPLIT_ARGS,
    do_not_specialize_on_alignment=[*_RUNTIME_SPLIT_ARGS, "req_rows_ptr", "kv_lens_ptr", "counter_ptr", "slots_ptr"],
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
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q and the newest K/V come from the previous kernels

    kv_len = tl.load(kv_lens_ptr + req).to(tl.int32)
    kv_begin = 0
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(kv_len - SLIDING_WINDOW, 0)
    split_len = tl.cdiv(tl.cdiv(kv_len - kv_begin, num_splits), BLOCK_N) * BLOCK_N
    start = kv_begin + split * split_len
    end = tl.minimum(start + split_len, kv_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q_rows = req * stride_qb + heads * stride_qh
    if ROTARY:
        offs_half = offs_d % (HEAD_DIM // 2)
        cos = tl.load(cos_ptr + req * stride_cos + offs_half, mask=mask_d, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + req * stride_sin + offs_half, mask=mask_d, other=0.0).to(tl.float32)
        q = _rotate_rows(q_ptr, q_rows, mask_g, cos, sin, offs_d, HEAD_DIM // 2, HEAD_DIM).to(q_ptr.dtype.element_ty)
        if (start < end) & (end == kv_len):  # this split holds the newest position
            slot = tl.load(slots_ptr + req).to(tl.int64)
            _store_new_token_kv(
                new_k_ptr + req * stride_nkb,
                new_v_ptr + req * stride_nvb,
                k_cache_ptr,
                v_cache_ptr,
                slot,
                kv_head,
                cos,
                sin,
                offs_d,
                stride_nkh,
                stride_nvh,
                stride_ks,
                stride_kh,
                stride_vs,
                stride_vh,
                HEAD_DIM,
            )
            tl.debug_barrier()  # every thread's cache stores precede this program's gathers of that slot
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
        m_i, l_i, acc = attend_kv_block(
            q,
            m_i,
            l_i,
            acc,
            slots,
            mask_n,
            mask_n[None, :],
            k_cache_ptr,
            v_cache_ptr,
            kv_head,
            offs_d,
            mask_d,
            stride_ks,
            stride_kh,
            stride_vs,
            stride_vh,
            qk_scale,
            DOT_PRECISION,
            SOFTCAP,
            EMPTY_ROWS=False,
        )

    if USE_PDL:
        if not MERGE:
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
        if MERGE:
            if start < end:  # the splits with work take tickets; the last one merges
                tl.debug_barrier()  # every thread's partial stores precede the ticket (released with it)
                counter = counter_ptr + req * stride_cb + kv_head
                ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                num_work = tl.cdiv(kv_len - kv_begin, split_len)
                if ticket == num_work - 1:
                    _merge_splits(
                        mid_out_ptr,
                        mid_lse_ptr,
                        out_ptr,
                        req,
                        kv_head,
                        num_work,
                        stride_mb,
                        stride_mh,
                        stride_ms,
                        stride_lb,
                        stride_lh,
                        stride_ob,
                        stride_oh,
                        GROUP,
                        HEAD_DIM,
                        BLOCK_D,
                        MERGE_G,
                        MERGE_CHUNK,
                    )
                    tl.store(counter, 0)  # every ticket is drawn: clean for the next launch or graph replay
    if USE_PDL:
        # Merged: the next kernel may start only once the merge is done. Triggered after the KV loop
        # instead, the batch-1 step ran 60 us slower (H200, Llama-3-8B; likely the o_proj GEMV's early
        # weight reads delaying the ticket and the merge's reads).
        if MERGE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=_RUNTIME_SPLIT_ARGS, do_not_specialize_on_alignment=_RUNTIME_SPLIT_ARGS)
def _decode_stage2_kernel(
    mid_out_ptr,  # [B, H, num_splits, D] fp32
    mid_lse_ptr,  # [B, H, num_splits] fp32
    out_ptr,  # [B, H, D]
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
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


def merge_chunk(group_pad: int, block_d: int) -> int:
    """Splits merged per iteration: about 4096 fp32 partial elements in registers (32 per thread)."""
    return max(1, min(16, 4096 // (group_pad * block_d)))


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
    counter = kv_lens  # never read unless MERGE
    if split_counter is not None and num_splits > 1:
        assert split_counter.dtype == torch.int32 and split_counter.shape[0] >= batch
        assert split_counter.shape[1] == num_kv_heads
        counter = split_counter
    merge = counter is split_counter
    rotary = _new_token_args(new_token, q, num_kv_heads)
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
        *rotary["tensors"],
        scale,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        counter.stride(0),
        *rotary["strides"],
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
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    if num_splits == 1 or merge:
        return out
    _decode_stage2_kernel[(batch, num_heads)](
        mid_out,
        mid_lse,
        out,
        num_splits,
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        USE_PDL=pdl,
        num_warps=4 if block_d >= 128 else 2,
        **launch_options(pdl),
    )
    return out


def _new_token_args(new_token: NewTokenKV | None, q: torch.Tensor, num_kv_heads: int) -> dict:
    """The stage-1 kernel's NewTokenKV tensors and strides (placeholders that are never read without one)."""
    if new_token is None:
        return dict(tensors=(q,) * 5, strides=(0,) * 6)
    k, v, cos, sin = new_token.k, new_token.v, new_token.cos, new_token.sin
    batch, _, head_dim = q.shape
    assert k.shape == v.shape == (batch, num_kv_heads, head_dim) and k.stride(2) == 1 and v.stride(2) == 1
    assert cos.shape == sin.shape == (batch, head_dim // 2) and cos.stride(1) == 1 and sin.stride(1) == 1
    assert head_dim % 2 == 0 and new_token.slots.shape == (batch,)
    return dict(
        tensors=(k, v, cos, sin, new_token.slots),
        strides=(k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0)),
    )


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
) -> torch.Tensor:
    """Each request's single query attends to its kv_len tokens (the last `sliding_window` of them
    when given), read through req_to_token."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for i, (row, kv_len) in enumerate(zip(req_rows.tolist(), kv_lens.tolist())):
        begin = max(0, kv_len - sliding_window) if sliding_window else 0
        slots = req_to_token[row, begin:kv_len].long()
        k = k_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
