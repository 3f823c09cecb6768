"""--diverse_mode's host side: decode rows grouped by the cached prefix they share, and the batch builder's table."""

from __future__ import annotations

import torch

from tgi_compat.modeling.forward_batch import ForwardMode, PrefixGroups
from tgi_compat.router.batch import StepBatchBuilder
from tgi_compat.router.prefix_cache import PrefixCache
from tgi_compat.router.prefix_groups import shared_prefix_groups
from tgi_compat.router.request import GenerateRequest, Request
from tgi_compat.router.step import ScheduledChunk, StepPlan


def test_siblings_group_by_their_shared_tree_path():
    prompt = list(range(100, 110))
    # a prefix-cache tree: the prompt's path, a branch after 6 tokens, an unrelated path
    leader = prompt
    siblings = prompt[:9]  # took prompt[:-1] from the cache
    branch = prompt[:6] + [900, 901]  # a common first 6 tokens, then other slots
    stranger = [500, 501, 502]
    groups = shared_prefix_groups([siblings, stranger, leader, [], siblings, branch], group_max=8)
    assert groups == [(6, [0, 2, 4, 5])]
    assert shared_prefix_groups([siblings, leader, stranger], group_max=8) == [(9, [0, 1])]
    assert shared_prefix_groups([stranger, [], leader], group_max=8) == []  # no two rows share


def test_large_sibling_sets_split_into_groups_of_group_max():
    path = list(range(20))
    groups = shared_prefix_groups([path] * 19, group_max=8)
    assert groups == [(20, list(range(8))), (20, list(range(8, 16))), (20, [16, 17, 18])]
    assert shared_prefix_groups([path] * 9, group_max=8) == [(20, list(range(8)))]  # a lone ninth: no group


def test_decode_steps_carry_the_group_table():
    cache = PrefixCache()
    cache.insert(list(range(12)), list(range(200, 212)))
    requests = []
    for i in range(3):
        request = Request(GenerateRequest(f"r{i}", list(range(12))), arrival=i, row=i, num_computed_tokens=14)
        if i < 2:  # siblings: the prompt's first 11 tokens from the cache
            request.cached_prefix = cache.match(list(range(11)))
        request.output_ids = [1, 2]
        requests.append(request)
    plan = StepPlan([ScheduledChunk(r, 14, 1, [300 + i], True) for i, r in enumerate(requests)])
    batch, _ = StepBatchBuilder("cpu", prefix_group_max=4).build(plan)
    assert batch.mode == ForwardMode.DECODE and batch.prefix_groups is not None
    assert batch.prefix_groups.table.tolist() == [[11, 0, 1, -1, -1], [11, -1, -1, -1, -1], [0, -1, -1, -1, -1]]
    plain, _ = StepBatchBuilder("cpu").build(plan)
    assert plain.prefix_groups is None
    assert torch.equal(plain.kv_lens, batch.kv_lens)


def test_group_rows_of_no_group():
    assert PrefixGroups.rows([], 2, 3) == [[0, -1, -1, -1]] * 2
