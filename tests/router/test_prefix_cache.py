"""The prefix cache's radix tree and its KV pool, against a plain dict model.

The model maps every cached token prefix (a tuple) to the slot of its last token. Random sequences
of admissions (match + lock + allocate), prompt sharing, releases and evictions must keep: every
slot in exactly one place (free list, tree, or a request's private tail), the locked prefixes
untouched, the tree equal to the model, and the pool full again after a flush.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.prefix_cache import PrefixCache, PrefixMatch

NUM_SLOTS = 48
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=10)  # 3 ids: many shared prefixes


def _tree_entries(cache: PrefixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix -> slot of its last token, walked without touching the tree."""
    entries, stack = {}, [((), cache.root)]
    while stack:
        path, node = stack.pop()
        for i, slot in enumerate(node.slots):
            entries[path + tuple(node.tokens[: i + 1])] = slot
        for child in node.children.values():
            stack.append((path + tuple(node.tokens), child))
    return entries


def _tree_nodes(cache: PrefixCache):
    """(path to the node's end, node) for every node but the root."""
    stack = [((), child) for child in cache.root.children.values()]
    while stack:
        path, node = stack.pop()
        path = path + tuple(node.tokens)
        yield path, node
        stack += [(path, child) for child in node.children.values()]


@dataclass
class _Running:
    tokens: list[int]
    slots: list[int]
    prefix: PrefixMatch | None

    @property
    def num_locked(self) -> int:
        return 0 if self.prefix is None else self.prefix.num_tokens


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KVSlotPool(NUM_SLOTS, 8, prefix_caching=True)
        self.cache = self.pool.prefix_cache
        self.model: dict[tuple[int, ...], int] = {}
        self.running: list[_Running] = []

    def _longest_cached(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.model:
            n += 1
        return n

    def _forget_evicted(self, before: set[int]) -> None:
        evicted = before - set(self.cache.cached_slots())
        self.model = {key: slot for key, slot in self.model.items() if slot not in evicted}

    def _add_to_model(self, tokens: list[int], slots: list[int]) -> None:
        for i in range(len(tokens)):
            self.model.setdefault(tuple(tokens[: i + 1]), slots[i])

    @rule(tokens=tokens_strategy)
    def admit(self, tokens: list[int]) -> None:
        """A request takes its longest cached prefix (all but its last token) and slots for the rest."""
        expected = self._longest_cached(tokens[:-1])
        prefix = self.pool.take_cached_prefix(tokens[:-1])
        num_hit = 0 if prefix is None else prefix.num_tokens
        assert num_hit == expected
        hit_slots = [] if prefix is None else prefix.slots
        assert hit_slots == [self.model[tuple(tokens[: i + 1])] for i in range(num_hit)]
        before = set(self.cache.cached_slots())
        new_slots = self.pool.allocate(len(tokens) - num_hit)
        self._forget_evicted(before)
        if new_slots is None:
            self.pool.release_cached_prefix(prefix)
            return
        self.running.append(_Running(tokens, hit_slots + new_slots, prefix))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def share_prompt(self, data) -> None:
        """A running request caches its written prefix and locks it instead of its old one."""
        request = data.draw(st.sampled_from(self.running))
        num_written = data.draw(st.integers(request.num_locked, len(request.tokens)))
        tokens = request.tokens[:num_written]
        is_new = self._longest_cached(tokens) == request.num_locked < len(tokens)
        request.prefix = self.pool.share_running(tokens, request.slots, request.prefix)
        if is_new:  # the tree took the request's own slots and it now locks all of `tokens`
            assert request.num_locked == len(tokens)
            self._add_to_model(tokens, request.slots)
        else:  # nothing new, or someone else cached part of its tail: it keeps its own slots
            assert request.num_locked <= len(tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release(self, data) -> None:
        """A request finishes or is preempted with its first `num_written` tokens' K/V written."""
        request = data.draw(st.sampled_from(self.running))
        num_written = data.draw(st.integers(request.num_locked, len(request.tokens)))
        self.running.remove(request)
        self.pool.cache_and_free(request.tokens[:num_written], request.slots, request.prefix)
        self._add_to_model(request.tokens[:num_written], request.slots)

    @rule(num_tokens=st.integers(1, NUM_SLOTS))
    def allocate_and_free(self, num_tokens: int) -> None:
        """Another request's allocation: evicts unlocked leaves when the free list is short."""
        before = set(self.cache.cached_slots())
        evictable = self.cache.num_evictable_tokens
        slots = self.pool.allocate(num_tokens)
        self._forget_evicted(before)
        if slots is None:
            assert num_tokens > len(self.pool._free_slots) + evictable
        else:
            assert len(set(slots)) == num_tokens
            self.pool.free(slots)

    @invariant()
    def every_slot_in_exactly_one_place(self) -> None:
        places = list(self.pool._free_slots) + self.cache.cached_slots()
        for request in self.running:
            places += request.slots[request.num_locked :]
        assert sorted(places) == list(range(NUM_SLOTS)), "a slot is owned twice or lost"

    @invariant()
    def tree_equals_model(self) -> None:
        assert _tree_entries(self.cache) == self.model

    @invariant()
    def locked_prefixes_stay_cached(self) -> None:
        for request in self.running:
            for i in range(request.num_locked):
                assert self.model.get(tuple(request.tokens[: i + 1])) == request.slots[i], "freed while locked"

    @invariant()
    def lock_refs_and_counts(self) -> None:
        num_locked = 0
        for path, node in _tree_nodes(self.cache):
            holders = sum(r.num_locked >= len(path) and tuple(r.tokens[: len(path)]) == path for r in self.running)
            assert node.lock_ref == holders
            num_locked += len(node.tokens) if holders else 0
        assert self.cache.num_locked_tokens == num_locked
        assert self.cache.num_cached_tokens == len(self.model)

    def teardown(self) -> None:
        for request in self.running:
            self.pool.cache_and_free(request.tokens, request.slots, request.prefix)
        assert self.pool.is_full_free()
        self.pool.flush_prefix_cache()
        assert sorted(self.pool._free_slots) == list(range(NUM_SLOTS))
        assert self.cache.num_cached_tokens == 0 and self.cache.num_locked_tokens == 0


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_eviction_takes_the_least_recently_used_leaf_first():
    cache = PrefixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([4, 5], [20, 21])
    cache.match([1, 2, 3])  # [1, 2, 3] is now the most recently used
    assert cache.evict(1) == [21]  # the tail of the least recently used leaf
    assert cache.match([4, 5]).slots == [20]
    assert cache.evict(2) == [11, 12]  # [4] was used last now
    assert cache.evict(10) == [10, 20]
    assert cache.num_cached_tokens == 0


def test_a_locked_path_is_never_evicted_and_a_split_keeps_the_lock():
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    match = cache.match([1, 2, 3, 4])
    cache.lock(match.node)
    assert cache.match([1, 2, 9]).slots == [10, 11]  # splits the locked node after two tokens
    assert cache.evict(100) == [] and cache.num_locked_tokens == 4
    cache.unlock(match.node)
    assert cache.num_evictable_tokens == 4 and sorted(cache.evict(100)) == [10, 11, 12, 13]


def test_insert_reports_the_tokens_already_cached():
    cache = PrefixCache()
    assert cache.insert([1, 2, 3], [10, 11, 12])[0] == 0
    assert cache.insert([1, 2, 4, 5], [30, 31, 32, 33])[0] == 2  # slots 30, 31 are the caller's duplicates
    num_present, node = cache.insert([1, 2], [40, 41])  # ends inside an edge: split there
    assert num_present == 2 and node.slots == [10, 11] and len(node.children) == 2
    assert cache.match([1, 2, 4, 5, 6]).slots == [10, 11, 32, 33]
    assert cache.num_cached_tokens == 5


def _shape(node) -> tuple:
    """A node's subtree as plain values: edges, slots, locks and LRU clocks."""
    children = tuple(_shape(node.children[k]) for k in sorted(node.children))
    return (tuple(node.tokens), tuple(node.slots), node.lock_ref, node.last_access, children)


@settings(max_examples=200, deadline=None)
@given(
    cached=st.lists(tokens_strategy, max_size=6),
    query=tokens_strategy,
    tail=st.lists(st.integers(0, 2), max_size=6),
)
def test_insert_after_a_locked_match_equals_an_insert_from_the_root(cached, query, tail):
    """A request's insert that starts at its locked prefix's node leaves the same tree (edges, slots,
    locks, LRU clocks) and returns the same as one that walks its whole history from the root;
    extends_past says what a matched_length past the prefix would."""
    outcomes = []
    for walk_from_prefix in (False, True):
        cache = PrefixCache()
        for i, tokens in enumerate(cached):
            cache.insert(tokens, [100 * i + j for j in range(len(tokens))])
        match = cache.match(query)
        cache.lock(match.node)
        for token in range(3):  # (share_running's O(1) check for a cached tail)
            longer = cache.matched_length(query[: match.num_tokens] + [token]) > match.num_tokens
            assert cache.extends_past(match, token) == longer
        tokens = query[: match.num_tokens] + tail
        num_present, node = cache.insert(
            tokens, match.slots + [900 + j for j in range(len(tail))], match if walk_from_prefix else None
        )
        outcomes.append((num_present, node.slots, _shape(cache.root)))
    assert outcomes[0] == outcomes[1]
