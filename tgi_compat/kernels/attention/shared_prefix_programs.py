"""The shared-prefix kernel's programs (`shared_prefix.py` launches them, one launch): a group's prefix for its
members' rows (with or without their own keys after it, `group_suffix`), and a row's own keys. Each stores
flash-decoding partials for the merge, or with FINAL the rows' outputs."""

from __future__ import annotations

import triton
import triton.language as tl

from tgi_compat.kernels.attention.decode import _attend_split
from tgi_compat.kernels.attention.online_softmax import attend_kv_block


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
def prefix_program(
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
def suffix_work(
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
