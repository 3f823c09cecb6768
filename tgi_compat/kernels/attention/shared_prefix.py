"""Shared-prefix (cascade) decode attention: the n / best_of siblings of one prompt read its KV once per step.

Siblings that took one prompt from the prefix cache hold the same KV slots for its first P tokens, so today's
flash-decoding (decode.py) reads those P keys once per sibling. Here a step's rows come in groups:

    table [B, 1 + G_MAX] int64 or int32:
        column 0 of row b: the length P of the prefix row b shares with its group (the first P slots of every
            member's req_to_token row are the leader's), 0 for a row in no group
        columns 1.. of row g: the batch positions of group g's rows (the first leads), -1 padding; groups are
            numbered from 0 in a row, so the rows past the last group hold -1 only

(tgi_compat.modeling.forward_batch.PrefixGroups.) Its shape is fixed by the batch size, so a CUDA graph captured
once replays any grouping.

One launch, two kinds of program (a KV head each), the long ones first: the grid is one-dimensional, every prefix
program of every KV head numbered before any suffix program (blocks start in the order of their index; on a grid
of (programs, KV heads) the last heads' prefix programs started behind the first heads' suffixes and ran at the tail):
- prefix: (split of [0, P), group slot s) takes the groups s, s + slots, ... and stacks each one's G_MAX rows x GQA
  query heads on the M side of one tl.dot (decode.py's `_attend_split`): each prefix KV block is read once for the
  group. Sized for full groups (`group_slots`, `choose_prefix_splits`); smaller groups only loop more.
- suffix: (row, split of [P, kv_len)): each row's own tokens (its whole context when it is in no group).
Both write flash-decoding partials (normalised output, log-sum-exp) into one scratch [B, H, S + PS, D]: suffix
splits at [0, S), prefix splits at [S, S + PS); decode_merge's stage 2 merges them. A split with no keys
stores lse = -inf (weight 0), so a row in no group has its prefix splits at -inf (the suffix's split 0 writes
them) and a row whose suffix is empty merges its prefix alone.

`group_suffix`: a group's prefix program also reads its members' own keys (split s of each member's suffix after
split s of the prefix, one loop over the blocks of both, each suffix block seen by its member's rows only), so the
suffix programs work only for rows in no group; they take their rows in turn (`suffix_programs` of them, not one per
row and split: a grouped row's turn is a table read). With one split each way every row's output comes from one
program: it is written final, with no partials and no stage 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.attention.decode import _attend_split, decode_attention_ref, dot_precision
from tgi_compat.kernels.attention.decode_merge import RUNTIME_SPLIT_ARGS, launch_stage2, split_outputs
from tgi_compat.kernels.attention.online_softmax import attend_kv_block

# Scratch strides and split counts follow the batch size: runtime values, one compiled kernel (decode_merge.py).
_RUNTIME_ARGS = [*RUNTIME_SPLIT_ARGS, "num_prefix_splits", "num_rows", "prefix_slots", "suffix_programs"]


@triton.jit
def _store_rows(
    m_i, l_i, acc, partials, output, positions, heads, valid, work, split, offs_d, mask_d, FINAL: tl.constexpr
):
    """FINAL: each `work` M row's output (acc / l) at (positions[m], heads[m]); it saw every key of its row. Else
    each valid M row's normalised partial output and log-sum-exp at split `split`: `work` rows, those that saw
    keys; the others -inf (weight 0) and no output."""
    rows = positions.to(tl.int64)
    if FINAL:
        out_ptr, stride_ob, stride_oh = output
        out_ptrs = out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        out = acc / tl.where(work, l_i, 1.0)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=work[:, None] & mask_d[None, :])
    else:
        mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh = partials
        l_safe = tl.where(work, l_i, 1.0)
        out_ptrs = mid_out_ptr + rows[:, None] * stride_mb + heads[:, None] * stride_mh + split * stride_ms
        tl.store(out_ptrs + offs_d[None, :], acc / l_safe[:, None], mask=work[:, None] & mask_d[None, :])
        lse = tl.where(work, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> ln
        tl.store(mid_lse_ptr + rows * stride_lb + heads * stride_lh + split, lse, mask=valid)


@triton.jit
def _load_q(q_ptr, positions, heads, valid, stride_qb, stride_qh, offs_d, mask_d, k_cache_ptr, scale):
    """The M rows' queries, and the score scale to use with them (an FP8 cache dots in fp16, as decode.py)."""
    q_ptrs = q_ptr + positions.to(tl.int64)[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)
    qk_scale = scale
    if k_cache_ptr.dtype.element_ty.is_fp8() and q_ptr.dtype.element_ty != tl.float32:
        q = (q.to(tl.float32) * scale).to(tl.float16)
        qk_scale = 1.0
    return q, qk_scale


@triton.jit
def _attend_rows(
    queries,  # (q_ptr, stride_qb, stride_qh, scale)
    head_cache,  # (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head)
    rows,  # (positions [M], heads [M], valid [M]): the M query rows
    keys,  # (req_to_token_ptr, stride_rt, the req_rows entry of the row whose slots to read, start, end)
    out_split,
    partials,
    output,
    M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FINAL: tl.constexpr,
):
    """The M query rows (positions[m], heads[m]) of one KV head attend to the keys [start, end) whose slots a
    req_to_token row lists, and store their partial at split `out_split` (FINAL: their output)."""
    q_ptr, stride_qb, stride_qh, scale = queries
    k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head = head_cache
    positions, heads, valid = rows
    req_to_token_ptr, stride_rt, req_row_ptr, start, end = keys
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q, qk_scale = _load_q(q_ptr, positions, heads, valid, stride_qb, stride_qh, offs_d, mask_d, k_cache_ptr, scale)
    head_kv = (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head, offs_d, mask_d)
    tokens_ptr = req_to_token_ptr + tl.load(req_row_ptr).to(tl.int64) * stride_rt
    m_i, l_i, acc = _attend_split(
        q, qk_scale, tokens_ptr, start, end, head_kv, DOT_PRECISION, SOFTCAP, M, BLOCK_D, BLOCK_N
    )
    work = valid & ((positions * 0 + start) < end)
    _store_rows(m_i, l_i, acc, partials, output, positions, heads, valid, work, out_split, offs_d, mask_d, FINAL)


@triton.jit
def _group_rows(table_ptr, stride_gb, slot, GROUP: tl.constexpr, G_MAX: tl.constexpr, M_PAD: tl.constexpr, kv_head):
    """The M rows of group slot `slot` for one KV head: M row m = (member m // GROUP, query head m % GROUP)."""
    offs_m = tl.arange(0, M_PAD)
    member = offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    positions = tl.load(table_ptr + slot * stride_gb + 1 + member, mask=member < G_MAX, other=-1)
    valid = positions >= 0
    return tl.where(valid, positions, 0), heads, valid, member


@triton.jit
def _group_with_suffixes(
    split,
    slot,
    leader,
    prefix_len,
    num_prefix_splits,
    out_split,
    queries,
    cache,
    tables,  # (req_to_token_ptr, stride_rt, req_rows_ptr, table_ptr, stride_gb, kv_lens_ptr)
    partials,
    output,
    GROUP: tl.constexpr,
    G_MAX: tl.constexpr,
    G_PAD: tl.constexpr,
    M_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FINAL: tl.constexpr,
):
    """Split `split` of one group's prefix, then split `split` of each member's own keys, in one loop over their
    blocks: a prefix block is seen by every member's rows, a member's block by its rows only."""
    req_to_token_ptr, stride_rt, req_rows_ptr, table_ptr, stride_gb, kv_lens_ptr = tables
    q_ptr, stride_qb, stride_qh, scale = queries
    k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head = cache
    positions, heads, valid, member = _group_rows(table_ptr, stride_gb, slot, GROUP, G_MAX, M_PAD, kv_head)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q, qk_scale = _load_q(q_ptr, positions, heads, valid, stride_qb, stride_qh, offs_d, mask_d, k_cache_ptr, scale)
    head_kv = (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head, offs_d, mask_d)
    # the prefix's split, in blocks
    split_len = tl.cdiv(tl.cdiv(prefix_len, num_prefix_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)
    prefix_blocks = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
    leader_row = tl.load(req_rows_ptr + leader).to(tl.int64)
    # each member's split of its own keys [prefix_len, kv_len), in blocks; their blocks follow the prefix's in turn
    offs_g = tl.arange(0, G_PAD)
    members = tl.load(table_ptr + slot * stride_gb + 1 + offs_g, mask=offs_g < G_MAX, other=-1)
    is_member = members >= 0
    members = tl.where(is_member, members, 0)
    own = tl.maximum(tl.load(kv_lens_ptr + members, mask=is_member, other=0).to(tl.int32) - prefix_len, 0)
    own_split = tl.maximum(tl.cdiv(tl.cdiv(own, num_prefix_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    own_lo = prefix_len + split * own_split
    own_hi = tl.minimum(own_lo + own_split, prefix_len + own)
    own_blocks = tl.where(is_member & (own_hi > own_lo), tl.cdiv(own_hi - own_lo, BLOCK_N), 0)
    own_ends = tl.cumsum(own_blocks, 0)  # member j's blocks are [own_ends[j] - own_blocks[j], own_ends[j])
    own_rows = tl.load(req_rows_ptr + members, mask=is_member, other=0).to(tl.int64)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, BLOCK_D], tl.float32)
    offs_block = tl.arange(0, BLOCK_N)
    for block in range(0, prefix_blocks + tl.sum(own_blocks, 0)):
        in_prefix = block < prefix_blocks
        own_block = block - prefix_blocks
        j = tl.sum((own_ends <= own_block).to(tl.int32), 0)  # the member whose keys (past the prefix's blocks)
        pick = offs_g == j
        j_first = tl.sum(tl.where(pick, own_ends - own_blocks, 0), 0)
        lo = tl.where(
            in_prefix, start + block * BLOCK_N, tl.sum(tl.where(pick, own_lo, 0), 0) + (own_block - j_first) * BLOCK_N
        )
        hi = tl.where(in_prefix, end, tl.sum(tl.where(pick, own_hi, 0), 0))
        row = tl.where(in_prefix, leader_row, tl.sum(tl.where(pick, own_rows, 0), 0))
        offs_n = lo + offs_block
        mask_n = offs_n < hi
        slots = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        sees = valid & (in_prefix | (member == j))
        m_i, l_i, acc = attend_kv_block(
            q, m_i, l_i, acc, slots, mask_n, sees[:, None] & mask_n[None, :], head_kv, qk_scale, DOT_PRECISION,
            SOFTCAP, EMPTY_ROWS=True,
        )  # fmt: skip
    work = valid & (m_i > float("-inf"))
    _store_rows(m_i, l_i, acc, partials, output, positions, heads, valid, work, out_split, offs_d, mask_d, FINAL)


@triton.jit
def _prefix_program(
    split,
    first_slot,
    num_slot_programs,
    num_rows,  # B: the table's rows, so its group slots
    num_prefix_splits,
    split_offset,  # the first prefix split's index in the scratch (the suffix's split count)
    queries,
    cache,
    tables,  # (req_to_token_ptr, stride_rt, req_rows_ptr, table_ptr, stride_gb, kv_lens_ptr)
    partials,
    output,
    GROUP: tl.constexpr,
    G_MAX: tl.constexpr,
    G_PAD: tl.constexpr,
    M_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    GROUP_SUFFIX: tl.constexpr,
    FINAL: tl.constexpr,
):
    """Split `split` of the prefix of groups first_slot, first_slot + num_slot_programs, ... for one KV head (and,
    GROUP_SUFFIX, of their members' own keys)."""
    req_to_token_ptr, stride_rt, req_rows_ptr, table_ptr, stride_gb, kv_lens_ptr = tables
    kv_head = cache[6]
    out_split = split_offset + split  # prefix splits follow the suffix's in the scratch
    # until the first row past the last group (all later ones are past it too)
    slot = first_slot
    leader = tl.load(table_ptr + slot * stride_gb + 1, mask=slot < num_rows, other=-1)
    while leader >= 0:
        next_slot = slot + num_slot_programs
        # loaded before the work, so that its latency hides behind it
        next_leader = tl.load(table_ptr + next_slot * stride_gb + 1, mask=next_slot < num_rows, other=-1)
        prefix_len = tl.load(table_ptr + leader * stride_gb).to(tl.int32)
        if GROUP_SUFFIX:
            _group_with_suffixes(
                split, slot, leader, prefix_len, num_prefix_splits, out_split, queries, cache, tables, partials,
                output, GROUP, G_MAX, G_PAD, M_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, SOFTCAP, FINAL,
            )  # fmt: skip
        else:
            split_len = tl.cdiv(tl.cdiv(prefix_len, num_prefix_splits), BLOCK_N) * BLOCK_N
            start = split * split_len
            end = tl.minimum(start + split_len, prefix_len)
            positions, heads, valid, _ = _group_rows(table_ptr, stride_gb, slot, GROUP, G_MAX, M_PAD, kv_head)
            keys = (req_to_token_ptr, stride_rt, req_rows_ptr + leader, start, end)  # the leader's slots
            _attend_rows(
                queries, cache, (positions, heads, valid), keys, out_split, partials, output, M_PAD, HEAD_DIM,
                BLOCK_D, BLOCK_N, DOT_PRECISION, SOFTCAP, False,
            )  # fmt: skip
        slot = next_slot
        leader = next_leader


@triton.jit
def _suffix_work(
    req,
    split,
    num_splits,
    num_prefix_splits,
    queries,
    cache,
    tables,
    partials,
    output,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    PREFIX_SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    GROUP_SUFFIX: tl.constexpr,
    FINAL: tl.constexpr,
):
    """Split `split` of row `req`'s own keys [P, kv_len) (its whole context when it is in no group). GROUP_SUFFIX:
    a grouped row's own keys are its group program's; its suffix split only stores weight 0 (nothing, FINAL)."""
    req_to_token_ptr, stride_rt, req_rows_ptr, table_ptr, stride_gb, kv_lens_ptr = tables
    mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh = partials
    kv_head = cache[6]
    prefix_len = tl.load(table_ptr + req * stride_gb).to(tl.int32)
    offs_g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + offs_g
    valid = offs_g < GROUP
    if GROUP_SUFFIX:
        grouped = prefix_len > 0
    else:
        grouped = prefix_len < 0  # (never: this program reads a grouped row's own keys too)
    if grouped:
        if not FINAL:
            lse_ptrs = mid_lse_ptr + req * stride_lb + heads * stride_lh + split
            tl.store(lse_ptrs, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=valid)
    else:
        kv_len = tl.load(kv_lens_ptr + req).to(tl.int32)
        split_len = tl.cdiv(tl.cdiv(kv_len - prefix_len, num_splits), BLOCK_N) * BLOCK_N
        split_len = tl.maximum(split_len, BLOCK_N)  # an empty suffix: every split empty, no zero-step range
        start = prefix_len + split * split_len
        end = tl.minimum(start + split_len, kv_len)
        positions = offs_g * 0 + req
        keys = (req_to_token_ptr, stride_rt, req_rows_ptr + req, start, end)
        _attend_rows(
            queries, cache, (positions, heads, valid), keys, split, partials, output, GROUP_PAD, HEAD_DIM, BLOCK_D,
            BLOCK_N, DOT_PRECISION, SOFTCAP, FINAL,
        )  # fmt: skip
        if not FINAL:
            if split == 0:
                if prefix_len == 0:  # in no group: no prefix program writes this row's prefix splits
                    offs_p = tl.arange(0, PREFIX_SPLITS_PAD)
                    lse_ptrs = mid_lse_ptr + req * stride_lb + heads[:, None] * stride_lh + num_splits + offs_p[None, :]
                    empty = tl.full([GROUP_PAD, PREFIX_SPLITS_PAD], float("-inf"), tl.float32)
                    tl.store(lse_ptrs, empty, mask=valid[:, None] & (offs_p < num_prefix_splits)[None, :])


@triton.jit(do_not_specialize=_RUNTIME_ARGS, do_not_specialize_on_alignment=_RUNTIME_ARGS)
def _shared_prefix_kernel(
    q_ptr,  # [B, H, D] (rotated)
    k_cache_ptr,  # [S, KVH, D]
    v_cache_ptr,
    req_to_token_ptr,  # [R, L] int32
    req_rows_ptr,  # [B]
    kv_lens_ptr,  # [B]
    table_ptr,  # [B, 1 + G_MAX]
    mid_out_ptr,  # [B, H, splits, D] fp32
    mid_lse_ptr,  # [B, H, splits] fp32
    out_ptr,  # [B, H, D]: written here when FINAL
    scale,
    num_splits,  # of each row's suffix
    num_prefix_splits,
    num_rows,  # B
    prefix_slots,  # the prefix's group programs
    suffix_programs,  # the suffix's programs (each takes every suffix_programs-th (row, split))
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    stride_gb,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    G_MAX: tl.constexpr,  # rows per group at most
    G_PAD: tl.constexpr,  # G_MAX rounded up to a power of two
    M_PAD: tl.constexpr,  # G_MAX * GROUP rounded up to a power of two, >= 16 (the M side of tl.dot)
    GROUP_PAD: tl.constexpr,  # GROUP, >= 16
    PREFIX_SPLITS_PAD: tl.constexpr,  # num_prefix_splits rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration over a suffix
    PREFIX_BLOCK_N: tl.constexpr,  # over a prefix
    DOT_PRECISION: tl.constexpr,
    GROUP_SUFFIX: tl.constexpr,  # the group programs read their members' own keys too
    FINAL: tl.constexpr,  # GROUP_SUFFIX with one split each way: outputs, not partials
    SOFTCAP: tl.constexpr = 0.0,
):
    """Programs [0, prefix_slots x num_prefix_splits x KV heads) take prefixes, the rest suffixes: one launch, so the
    suffix programs fill the SMs that the prefix's leave at its tail. The KV head varies fastest."""
    program = tl.program_id(0)
    kv_head = program % KV_HEADS
    pid = program // KV_HEADS
    queries = (q_ptr, stride_qb, stride_qh, scale)
    cache = (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head)
    tables = (req_to_token_ptr, stride_rt, req_rows_ptr, table_ptr, stride_gb, kv_lens_ptr)
    partials = (mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh)
    output = (out_ptr, stride_ob, stride_oh)
    num_prefix_programs = prefix_slots * num_prefix_splits
    if pid < num_prefix_programs:
        split, slot = pid % num_prefix_splits, pid // num_prefix_splits
        _prefix_program(
            split, slot, prefix_slots, num_rows, num_prefix_splits, num_splits, queries, cache, tables, partials,
            output, GROUP, G_MAX, G_PAD, M_PAD, HEAD_DIM, BLOCK_D, PREFIX_BLOCK_N, DOT_PRECISION, SOFTCAP,
            GROUP_SUFFIX, FINAL,
        )  # fmt: skip
    elif GROUP_SUFFIX:  # the (row, split)s pid - num_prefix_programs, + suffix_programs, ...
        for work in range(pid - num_prefix_programs, num_rows * num_splits, suffix_programs):
            _suffix_work(
                work // num_splits, work % num_splits, num_splits, num_prefix_splits, queries, cache, tables,
                partials, output, GROUP, GROUP_PAD, PREFIX_SPLITS_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION,
                SOFTCAP, GROUP_SUFFIX, FINAL,
            )  # fmt: skip
    else:  # one (row, split) a program
        work = pid - num_prefix_programs
        _suffix_work(
            work // num_splits, work % num_splits, num_splits, num_prefix_splits, queries, cache, tables, partials,
            output, GROUP, GROUP_PAD, PREFIX_SPLITS_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, SOFTCAP,
            GROUP_SUFFIX, FINAL,
        )  # fmt: skip


# Prefix programs per SM: one wave of the 3 an SM holds at two stages of 64-key K and V tiles (64 KB of shared
# memory; at the backend's three, 76 KB, an H100 SM holds 2, and 3 of the group_suffix form's 70 KB), all as long,
# so they end together. 4 splits of 8 groups x 8 KV heads (256 programs, 132 SMs) read ~1 TB/s; many
# shorter splits add partials (M_PAD x D fp32 each) to write and merge. benchmarks/device/diverse.py sweeps it.
PREFIX_PROGRAMS_PER_SM = 3


def group_slots(batch_size: int, group_max: int) -> int:
    """The prefix's group programs: one per group of a batch of full groups (n = group_max siblings each)."""
    return max(1, -(-batch_size // group_max))


def choose_prefix_splits(
    batch_size: int, group_max: int, num_kv_heads: int, num_sms: int, max_prefix_len: int, block_n: int, max_splits: int
) -> int:
    """The splits of each group's prefix, from static maxima only (graph-safe): the nearest to PREFIX_PROGRAMS_PER_SM
    programs per SM over a batch of full groups, at most one split per key block of the longest prefix."""
    programs = group_slots(batch_size, group_max) * num_kv_heads
    splits = (PREFIX_PROGRAMS_PER_SM * num_sms + programs // 2) // programs
    return max(1, min(splits, -(-max_prefix_len // block_n), max_splits))


# Suffix programs per SM where the group programs read their members' own keys: the suffix's work is then the rows
# in no group, taken in turn, and a grouped row's turn is a table read.
SUFFIX_PROGRAMS_PER_SM = 8


def choose_suffix_programs(
    batch_size: int, num_splits: int, num_kv_heads: int, num_sms: int, group_suffix: bool
) -> int:
    """The suffix's programs (each KV head's): one per (row, split), or with `group_suffix` at most
    SUFFIX_PROGRAMS_PER_SM per SM over the KV heads."""
    work = batch_size * num_splits
    if not group_suffix:
        return work
    return max(1, min(work, -(-SUFFIX_PROGRAMS_PER_SM * num_sms // num_kv_heads)))


def shared_prefix_decode_attention(
    q: torch.Tensor,  # [B, H, D], rotated
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,  # [R, L] int32
    req_rows: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B]
    table: torch.Tensor,  # [B, 1 + G_MAX] int64 or int32: see the module docstring
    scale: float,
    num_splits: int,  # of each row's suffix
    num_prefix_splits: int,  # of each group's prefix
    out: torch.Tensor | None = None,  # [B, H, D]
    mid_out: torch.Tensor | None = None,  # [>=B, H, >= num_splits + num_prefix_splits, D] fp32 scratch
    mid_lse: torch.Tensor | None = None,  # [>=B, H, >= num_splits + num_prefix_splits] fp32 scratch
    block_n: int = 64,
    prefix_block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    softcap: float | None = None,
    prefix_slots: int = 0,  # group programs (each takes every slots-th group); 0: group_slots()
    group_suffix: bool = False,  # the group programs read their members' own keys too (module docstring)
    suffix_programs: int = 0,  # 0: one per (row, split), or choose_suffix_programs' with group_suffix
) -> torch.Tensor:
    """Decode attention of B one-token rows where groups of rows share their first prefix_lens keys: the
    prefix is read once per group, each row's suffix once per row, and the two merged by log-sum-exp."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group_max = k_cache.shape[1], table.shape[1] - 1
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert table.dtype in (torch.int32, torch.int64) and table.stride(1) == 1 and table.shape[0] == batch
    assert num_splits >= 1 and num_prefix_splits >= 1
    group = num_heads // num_kv_heads
    total_splits = num_splits + num_prefix_splits
    out, mid_out, mid_lse = split_outputs(q, total_splits, out, mid_out, mid_lse)
    if batch == 0:
        return out
    # the meta-parameters both stages take alike
    meta = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=float(softcap or 0.0),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    common = (*q.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2], req_to_token.stride(0))
    scratch = (*mid_out.stride()[:3], *mid_lse.stride()[:2])
    prefix_slots = prefix_slots or group_slots(batch, group_max)
    if not suffix_programs:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        suffix_programs = choose_suffix_programs(batch, num_splits, num_kv_heads, num_sms, group_suffix)
    final = group_suffix and num_splits == 1 and num_prefix_splits == 1
    programs = prefix_slots * num_prefix_splits + suffix_programs
    _shared_prefix_kernel[(programs * num_kv_heads,)](
        q, k_cache, v_cache, req_to_token, req_rows, kv_lens, table, mid_out, mid_lse, out,
        scale, num_splits, num_prefix_splits, batch, prefix_slots, suffix_programs, *common, table.stride(0),
        *scratch, *out.stride()[:2],
        KV_HEADS=num_kv_heads,
        GROUP=group,
        G_MAX=group_max,
        G_PAD=triton.next_power_of_2(group_max),
        M_PAD=max(16, triton.next_power_of_2(group_max * group)),
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        PREFIX_SPLITS_PAD=triton.next_power_of_2(num_prefix_splits),
        BLOCK_N=block_n,
        PREFIX_BLOCK_N=prefix_block_n,
        GROUP_SUFFIX=group_suffix,
        FINAL=final,
        **meta,
    )  # fmt: skip
    if not final:
        launch_stage2(
            mid_out[:batch, :, :total_splits], mid_lse[:batch, :, :total_splits], out, total_splits, pdl=False
        )
    return out


def shared_prefix_decode_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    table: torch.Tensor,  # [B, 1 + G_MAX]
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The definition: row b attends to its group's first P keys through its leader's req_to_token row, then to
    its own keys [P, kv_len) through its own row (decode_attention_ref over a table that splices the two)."""
    spare = req_to_token.shape[0]  # row spare + b: row b's spliced slots
    spliced = torch.cat([req_to_token, req_to_token.new_zeros(q.shape[0], req_to_token.shape[1])])
    own_rows = req_rows.clone()
    prefix_lens = table[:, 0].tolist()
    for row_members in table[:, 1:].tolist():  # group g's positions in row g, the leader first
        members = [p for p in row_members if p >= 0]
        for position in members:
            prefix = prefix_lens[position]
            spliced[spare + position] = req_to_token[int(req_rows[position])]
            spliced[spare + position, :prefix] = req_to_token[int(req_rows[members[0]]), :prefix]
            own_rows[position] = spare + position
    return decode_attention_ref(q, k_cache, v_cache, spliced, own_rows, kv_lens, scale, softcap=softcap)
