"""The host paths of a prefix-cache hit that must stay O(1) Python per request: the common-prefix
length of two long prompts, and the (row, position, slot) table of a step's hits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tgi_compat.router.batch import _cached_prefix_slots
from tgi_compat.router.prefix_cache import common_prefix_length


def naive_common_length(a: list[int], b: list[int], start: int, limit: int | None) -> int:
    n = 0
    while n < len(a) and start + n < len(b) and (limit is None or n < limit) and a[n] == b[start + n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(
    shared=st.integers(0, 600),
    tail_a=st.lists(st.integers(0, 3), max_size=40),
    tail_b=st.lists(st.integers(0, 3), max_size=40),
    start=st.integers(0, 5),
    limit=st.one_of(st.none(), st.integers(0, 700)),
)
def test_common_prefix_length_equals_a_token_by_token_scan(shared, tail_a, tail_b, start, limit):
    common = [7 + (i % 5) for i in range(shared)]  # long shared runs cross the doubling slices
    a = common + tail_a
    b = [9] * start + common + tail_b
    assert common_prefix_length(a, b, start, limit) == naive_common_length(a, b, start, limit)


def expanded(prefixes: list[tuple[int, list[int]]]) -> list[list[int]]:
    rows, positions, slots = [], [], []
    for row, prefix in prefixes:
        rows += [row] * len(prefix)
        positions += range(len(prefix))
        slots += prefix
    return [rows, positions, slots]


def test_hit_table_shares_equal_prefixes_and_keeps_lookalikes_apart():
    system = list(range(1000, 1300))
    lookalike = system[:150] + [5] + system[151:]  # same length, first and last slot: not the same list
    prefixes = [(3, list(system)), (0, list(system)), (7, lookalike), (2, system[:40]), (5, list(system)), (1, [42])]
    table = _cached_prefix_slots(prefixes, torch.device("cpu"))
    assert table.tolist() == expanded(prefixes)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=12))
def test_hit_table_equals_the_plain_expansion(hits):
    pool = [list(range(100 * k, 100 * k + 40)) for k in range(4)]
    prefixes = [(row, pool[which][:length]) for row, length, which in hits]
    assert _cached_prefix_slots(prefixes, torch.device("cpu")).tolist() == expanded(prefixes)
