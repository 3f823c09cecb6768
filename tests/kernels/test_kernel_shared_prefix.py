"""Shared-prefix (diverse-mode) decode attention against its torch reference and against plain flash-decoding
(GQA, ragged suffixes, groups of 1..8, rows in no group, empty suffixes, more rows than a group holds)."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.attention.decode import decode_attention_ref
from tgi_compat.kernels.attention.shared_prefix import (
    choose_prefix_splits,
    group_slots,
    shared_prefix_decode_attention,
    shared_prefix_decode_ref,
)
from tgi_compat.modeling.forward_batch import PrefixGroups

HEAD_DIM = 16


def sibling_batch(
    prefix_len: int, group_sizes: list[int], loners: list[int], suffix_lens: list[int], num_kv_heads: int, seed: int
):
    """Rows of groups (each group's rows hold the same slots for the first prefix_len tokens) then rows in no
    group (kv lengths `loners`); suffix_lens[i]: grouped row i's own tokens after the prefix. Rows sit in shuffled
    req_to_token rows; the batch order interleaves the groups."""
    gen = torch.Generator().manual_seed(seed)
    num_grouped = sum(group_sizes)
    kv_lens = [prefix_len + s for s in suffix_lens[:num_grouped]] + loners
    num_slots = 64 + len(group_sizes) * prefix_len + sum(kv_lens)
    k_cache = torch.randn(num_slots, num_kv_heads, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, HEAD_DIM, generator=gen)
    free = torch.randperm(num_slots, generator=gen).tolist()
    max_len = max(kv_lens) + 2
    req_to_token = torch.zeros(len(kv_lens) + 1, max_len, dtype=torch.int32)
    order = torch.randperm(len(kv_lens), generator=gen).tolist()  # batch position of each row
    req_rows = torch.randperm(len(kv_lens) + 1, generator=gen)[: len(kv_lens)]
    groups: list[tuple[int, list[int]]] = []
    index = 0
    for size in group_sizes:
        prefix = [free.pop() for _ in range(prefix_len)]
        positions = [order[index + k] for k in range(size)]
        for position in positions:
            own = [free.pop() for _ in range(kv_lens[order.index(position)] - prefix_len)]
            req_to_token[req_rows[position], : prefix_len + len(own)] = torch.tensor(prefix + own, dtype=torch.int32)
        groups.append((prefix_len, positions))
        index += size
    for k in range(len(loners)):
        position = order[index + k]
        slots = [free.pop() for _ in range(loners[k])]
        req_to_token[req_rows[position], : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    lens_by_position = torch.tensor([kv_lens[order.index(p)] for p in range(len(kv_lens))])
    return k_cache, v_cache, req_to_token, req_rows, lens_by_position, groups


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize(
    ("group", "group_sizes", "loners", "splits", "prefix_splits"),
    [
        (4, [3, 1, 2], [9, 40], 2, 3),  # GQA 4, groups of 1..3 beside two rows in no group
        (1, [8], [], 1, 1),  # a full group of 8, MHA, one split each way
        (2, [5, 4], [1], 3, 8),  # more prefix splits than the prefix has blocks
    ],
)
@pytest.mark.parametrize("group_suffix", [False, True], ids=["suffix-programs", "group-suffix"])
def test_shared_prefix_matches_references(
    group: int, group_sizes: list[int], loners: list[int], splits: int, prefix_splits: int, group_suffix: bool
):
    num_kv_heads = 2
    suffix_lens = [1, 18, 3, 0, 33, 2, 7, 1, 5]  # ragged, one empty (the prefix alone)
    k_cache, v_cache, r2t, rows, kv_lens, groups = sibling_batch(37, group_sizes, loners, suffix_lens, num_kv_heads, 3)
    batch = kv_lens.shape[0]
    table = torch.tensor(PrefixGroups.rows(groups, batch, group_max=8), dtype=torch.int32)
    prefix = PrefixGroups(table)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(batch, num_kv_heads * group, HEAD_DIM, generator=gen)
    args = (q, k_cache, v_cache, r2t, rows, kv_lens, prefix.table, 0.3)
    out = shared_prefix_decode_attention(
        *args,
        num_splits=splits,
        num_prefix_splits=prefix_splits,
        block_n=16,
        prefix_block_n=16,
        group_suffix=group_suffix,
    )
    ref = shared_prefix_decode_ref(*args)
    assert relative_error(out, ref) < 1e-5
    # the rows' tables really share the prefix: the reference is plain decode attention
    assert relative_error(ref, decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv_lens, 0.3)) < 1e-6


@pytest.mark.parametrize(
    ("prefix_splits", "prefix_slots"),
    [
        (1, 1),  # one program per KV head walks every group's whole prefix
        (2, 0),  # 0: the slots of full groups (one here), so it takes both groups in turn
        (3, 2),  # 37 keys in 3 splits of 16: the last split only partly filled (5 keys)
        (4, 3),  # the 4th split starts past the prefix: empty, its weight 0; more slots than groups
        (5, 1),
    ],
)
@pytest.mark.parametrize("group_suffix", [False, True], ids=["suffix-programs", "group-suffix"])
def test_shared_prefix_split_counts_and_group_slots(prefix_splits: int, prefix_slots: int, group_suffix: bool):
    """Every split count the backend may pick (choose_prefix_splits) and every number of group programs (each takes
    every slots-th group), over groups of 3 and 5 and a row in no group. With group_suffix and one prefix split, the
    outputs are written final (no partials, no stage 2)."""
    k_cache, v_cache, r2t, rows, kv_lens, groups = sibling_batch(37, [3, 5], [21], [4, 1, 0, 9, 2, 16, 3, 1], 2, 8)
    batch = kv_lens.shape[0]
    table = torch.tensor(PrefixGroups.rows(groups, batch, group_max=8), dtype=torch.int64)
    q = torch.randn(batch, 4, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    args = (q, k_cache, v_cache, r2t, rows, kv_lens, table, 0.3)
    out = shared_prefix_decode_attention(
        *args, 1, prefix_splits, block_n=16, prefix_block_n=16, prefix_slots=prefix_slots, group_suffix=group_suffix
    )
    assert relative_error(out, shared_prefix_decode_ref(*args)) < 1e-5


@pytest.mark.parametrize(("splits", "prefix_splits"), [(1, 1), (2, 3)], ids=["final", "partials"])
@pytest.mark.parametrize("suffix_programs", [1, 3, 100])
def test_group_suffix_takes_rows_in_turn(splits: int, prefix_splits: int, suffix_programs: int):
    """With the group programs reading their members' own keys, the suffix programs take the (row, split)s in turn:
    one program for every row, a few, or more programs than work (the extra ones idle). Rows in no group of every
    length, among groups whose members' own keys are empty, a block or several."""
    lens = [0, 16, 17, 1, 40, 33, 2, 15]
    k_cache, v_cache, r2t, rows, kv_lens, groups = sibling_batch(21, [4, 4], [3, 50, 16], lens, 2, 5)
    batch = kv_lens.shape[0]
    table = torch.tensor(PrefixGroups.rows(groups, batch, group_max=8), dtype=torch.int32)
    q = torch.randn(batch, 8, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    args = (q, k_cache, v_cache, r2t, rows, kv_lens, table, 0.3)
    out = shared_prefix_decode_attention(
        *args, splits, prefix_splits, block_n=16, prefix_block_n=16, group_suffix=True, suffix_programs=suffix_programs
    )
    assert relative_error(out, shared_prefix_decode_ref(*args)) < 1e-5


def test_choose_prefix_splits_fills_the_sms_within_the_prefix_blocks():
    # 8 full groups x 8 KV heads on 132 SMs: 3 programs per SM -> 6 splits, 384 programs (it ran 4 before)
    assert choose_prefix_splits(64, 8, 8, 132, 4096, 64, 63) == 6
    assert choose_prefix_splits(128, 8, 8, 132, 4096, 64, 63) == 3
    assert choose_prefix_splits(8, 8, 8, 132, 4096, 64, 40) == 40  # one group: bounded by the merge's splits
    assert choose_prefix_splits(8, 8, 8, 132, 200, 64, 63) == 4  # a short context: one split per key block
    assert choose_prefix_splits(512, 8, 8, 132, 4096, 64, 63) == 1
    assert group_slots(64, 8) == 8 and group_slots(65, 8) == 9 and group_slots(1, 8) == 1


def test_shared_prefix_without_groups_is_flash_decoding_and_reads_the_leaders_prefix():
    """No group at all (an all-empty table: every row through its suffix kernel), and a group whose members'
    own rows hold other slots for the prefix: the prefix is read through the leader's row (the reference's
    definition)."""
    k_cache, v_cache, r2t, rows, kv_lens, groups = sibling_batch(20, [3], [5, 17], [2, 9, 4], 2, 5)
    batch = kv_lens.shape[0]
    q = torch.randn(batch, 4, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    empty = PrefixGroups(torch.tensor(PrefixGroups.rows([], batch, group_max=4), dtype=torch.int32))
    args = (q, k_cache, v_cache, r2t, rows, kv_lens)
    out = shared_prefix_decode_attention(*args, empty.table, 0.25, 2, 4, block_n=16)
    assert relative_error(out, decode_attention_ref(*args, 0.25)) < 1e-5

    _, positions = groups[0]
    r2t[rows[positions[1]], :20] = r2t[rows[positions[1]], :20].flip(0)  # a member's own copy, permuted
    grouped = PrefixGroups(torch.tensor(PrefixGroups.rows(groups, batch, group_max=4), dtype=torch.int32))
    full = (*args, grouped.table, 0.25)
    out = shared_prefix_decode_attention(*full, num_splits=1, num_prefix_splits=2, block_n=16, prefix_block_n=16)
    assert relative_error(out, shared_prefix_decode_ref(*full)) < 1e-5


def test_shared_prefix_half_precision_and_softcap():
    k_cache, v_cache, r2t, rows, kv_lens, groups = sibling_batch(50, [4], [12], [3, 1, 6, 2], 1, 9)
    batch = kv_lens.shape[0]
    table = PrefixGroups(torch.tensor(PrefixGroups.rows(groups, batch, group_max=4), dtype=torch.int32))
    q = torch.randn(batch, 4, HEAD_DIM, generator=torch.Generator().manual_seed(2)).half()
    args = (q, k_cache.half(), v_cache.half(), r2t, rows, kv_lens, table.table, 0.25)
    out = shared_prefix_decode_attention(
        *args, num_splits=2, num_prefix_splits=2, block_n=16, prefix_block_n=16, softcap=5.0
    )
    ref = shared_prefix_decode_ref(*args, softcap=5.0)
    assert out.dtype == torch.float16
    assert relative_error(out, ref) < 5e-3


def test_prefix_group_rows():
    rows = PrefixGroups.rows([(10, [2, 0]), (4, [1])], batch_size=4, group_max=3)
    assert rows == [[10, 2, 0, -1], [4, 1, -1, -1], [10, -1, -1, -1], [0, -1, -1, -1]]  # group g's positions: row g
