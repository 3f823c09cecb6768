"""--diverse_mode's host side: decode rows grouped at the deepest prefix-cache node they share, and the decode
step's group table."""

from __future__ import annotations

import torch

from tgi_compat.modeling.forward_batch import ForwardMode, PrefixGroups
from tgi_compat.router.batch import StepBatchBuilder
from tgi_compat.router.prefix_cache import PrefixCache, PrefixMatch
from tgi_compat.router.prefix_groups import GroupCounts, shared_prefix_groups
from tgi_compat.router.request import GenerateRequest, Request
from tgi_compat.router.step import ScheduledChunk, StepPlan

SYSTEM = list(range(1, 9))  # 8 tokens every prompt starts with


def running(cache: PrefixCache, tokens: list[int]) -> PrefixMatch:
    """A running request's locked prefix: the cached part of `tokens` (all but the last token, as admission
    takes it), then, unless the cache already goes on from there, its prompt published as its own (as
    KVSlotPool.share_running does when its prefill ends)."""
    match = cache.match(tokens[:-1])
    cache.lock(match.node)
    if not cache.extends_past(match, tokens[match.num_tokens]):
        slots = match.slots + [1000 + len(cache.cached_slots()) + k for k in range(len(tokens) - match.num_tokens)]
        _, node = cache.insert(tokens, slots, match)
        cache.lock(node)
        cache.unlock(match.node)
        match = PrefixMatch(slots, node)
    return match


def test_siblings_anchor_at_their_prompt_and_strangers_at_the_system_prompt():
    cache = PrefixCache()
    prompt_a, prompt_b = SYSTEM + [20, 21, 22, 23], SYSTEM + [30, 31, 32]
    leader = running(cache, prompt_a)  # prefilled prompt_a and published it
    siblings = [running(cache, prompt_a) for _ in range(3)]  # took prompt_a[:-1] from the cache
    other = running(cache, prompt_b)  # shares the system prompt only
    lone = running(cache, [99, 98, 97])  # shares nothing
    prefixes = [siblings[0], other, leader, None, lone, siblings[1], siblings[2]]
    anchors = [None if p is None else p.shared_node() for p in prefixes]
    assert anchors[3] is None and anchors[4] is None
    assert anchors[1] is not None and anchors[1][1] == len(SYSTEM)  # the system prompt's node
    assert {a[1] for a in (anchors[0], anchors[2], anchors[5], anchors[6]) if a} == {len(prompt_a) - 1}
    assert shared_prefix_groups(anchors, group_max=8) == [(len(prompt_a) - 1, [0, 2, 5, 6])]
    # the stranger groups with a second request on the system prompt alone
    other_too = running(cache, SYSTEM + [40, 41])
    anchors.append(other_too.shared_node())
    groups = shared_prefix_groups(anchors, group_max=8)
    assert (len(SYSTEM), [1, 7]) in groups and len(groups) == 2


def test_large_sibling_sets_split_into_groups_of_group_max():
    anchor = (object(), 20)
    assert shared_prefix_groups([anchor] * 19, group_max=8) == [
        (20, list(range(8))),
        (20, list(range(8, 16))),
        (20, [16, 17, 18]),
    ]
    assert shared_prefix_groups([anchor] * 9, group_max=8) == [(20, list(range(8)))]  # a lone ninth: no group
    assert shared_prefix_groups([anchor] * 3, group_max=8, min_shared=21) == []


def test_decode_steps_carry_the_group_table():
    cache = PrefixCache()
    prompt = list(range(1, 13))
    prefixes = [running(cache, prompt), running(cache, prompt), None]
    requests = []
    for i, prefix in enumerate(prefixes):
        request = Request(GenerateRequest(f"r{i}", prompt), arrival=i, row=i, num_computed_tokens=14)
        request.cached_prefix = prefix
        request.output_ids = [1, 2]
        requests.append(request)
    plan = StepPlan([ScheduledChunk(r, 14, 1, [300 + i], True) for i, r in enumerate(requests)])
    builder = StepBatchBuilder("cpu", prefix_group_max=4)
    batch, _ = builder.build(plan)
    assert batch.mode == ForwardMode.DECODE and batch.prefix_groups is not None
    assert batch.prefix_groups.table.tolist() == [[11, 0, 1, -1, -1], [11, -1, -1, -1, -1], [0, -1, -1, -1, -1]]
    builder.build(plan)  # the counts the engine reports (EngineStats.diverse_*) add up over the steps
    assert builder.group_counts == GroupCounts(steps=2, rows=6, grouped_rows=4, groups=2, largest=2)
    plain, _ = StepBatchBuilder("cpu").build(plan)
    assert plain.prefix_groups is None
    assert torch.equal(plain.kv_lens, batch.kv_lens)


def test_group_rows_of_no_group():
    assert PrefixGroups.rows([], 2, 3) == [[0, -1, -1, -1]] * 2
