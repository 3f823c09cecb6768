"""Prefix caching: a radix tree over token ids whose values are KV slot numbers (SGLang's
RadixAttention at page size 1, LightLLM's dynamic prompt cache).

    root ─[The, cat]─▶ node ─[sat]─▶ leaf        each edge holds token ids and, token for token,
                          └─[ran, off]─▶ leaf     the KV slots that hold those tokens' K/V

A token's K/V depends only on the tokens before it, so two sequences that share a prefix can share
its slots. The tree owns the slots it holds; nothing in it is on the free list.

Lock refs: a running request that took a cached prefix locks its path (`lock` / `unlock` count up
to the root) so that eviction never frees slots its `req_to_token` row still points at. Unlocked
leaves are evicted least recently used first when the pool runs short (`evict`).

The tree is pure host bookkeeping over ints: no tensors, no free list; the KV pool (kv_slots.py)
frees what `insert` reports as duplicates and what `evict` hands back.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class _Node:
    tokens: list[int]  # token ids on the edge from the parent
    slots: list[int]  # KV slot of each of those tokens
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # first token of the child's edge -> child
    lock_ref: int = 0  # running requests whose cached prefix passes through here
    last_access: int = 0  # LRU clock tick of the last match or insert through here

    @property
    def parent_node(self) -> _Node:
        """The parent of a non-root node (only the root has none)."""
        assert self.parent is not None, "the root has no parent"
        return self.parent


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a sequence: its slots, and the node that ends it (the handle a
    request locks while it runs on these slots)."""

    slots: list[int]
    node: _Node

    @property
    def num_tokens(self) -> int:
        return len(self.slots)

    def shared_node(self) -> tuple[_Node, int] | None:
        """The deepest node of this locked path that another locked path (another running request's) passes
        through too, and its depth (tokens from the root to its end); None when they share only the root. Every
        request anchored at one node holds the same first `depth` slots: n / best_of siblings anchor at their
        prompt's node (--diverse_mode's groups, tgi_compat/router/prefix_groups.py)."""
        node = self.node
        while node.parent is not None and node.lock_ref < 2:  # (the root's parent is None)
            node = node.parent
        if node.parent is None:
            return None
        depth, above = 0, node
        while above.parent is not None:
            depth += len(above.tokens)
            above = above.parent
        return node, depth


class PrefixCache:
    def __init__(self) -> None:
        self.root = _Node(tokens=[], slots=[], parent=None, lock_ref=1)  # the root is never evicted
        self._clock = itertools.count(1)
        self.num_cached_tokens = 0  # slots the tree holds
        self.num_locked_tokens = 0  # of those, in nodes that a running request locks

    @property
    def num_evictable_tokens(self) -> int:
        return self.num_cached_tokens - self.num_locked_tokens

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens`. Splits the node where the match ends inside one,
        so that the returned node ends exactly at the match; refreshes the path's LRU clock."""
        now = next(self._clock)
        node, matched, slots = self.root, 0, []
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            common = _common_length(child.tokens, tokens, matched)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_access = now
            slots += child.slots
            matched += common
            node = child
        return PrefixMatch(slots, node)

    def matched_length(self, tokens: list[int]) -> int:
        """Length of the cached prefix of `tokens`, changing nothing (no split, no LRU refresh)."""
        node, matched = self.root, 0
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            common = _common_length(child.tokens, tokens, matched)
            matched += common
            if common < len(child.tokens):
                break
            node = child
        return matched

    def extends_past(self, prefix: PrefixMatch | None, token: int) -> bool:
        """True when some cached sequence goes on from `prefix` (None: the empty prefix) with `token`."""
        return token in (self.root if prefix is None else prefix.node).children

    # ---- insert -------------------------------------------------------------------------
    def insert(self, tokens: list[int], slots: list[int], after: PrefixMatch | None = None) -> tuple[int, _Node]:
        """Cache `tokens` with their `slots`. Returns how many leading tokens were cached already
        (the caller's slots for those are duplicates that the tree did not take: the caller frees
        whichever of them it owns; the tree takes the rest) and the node that ends at `tokens`.

        `after`: a locked match of the leading tokens (a request's own prefix; a locked node is
        never evicted or cut, and a split leaves it ending where it did). The walk starts at its
        node, so a chat turn's insert costs its new tokens, not its whole history again."""
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        now = next(self._clock)
        node, matched = self.root, 0
        if after is not None:
            node, matched = after.node, after.num_tokens
            self._touch(node, now)  # the path above it, as a walk from the root would
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            common = _common_length(child.tokens, tokens, matched)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_access = now
            matched += common
            node = child
        if matched < len(tokens):
            leaf = _Node(tokens[matched:], slots[matched:], node, last_access=now)
            node.children[tokens[matched]] = leaf
            self.num_cached_tokens += len(leaf.tokens)
            return matched, leaf
        return matched, node

    def _touch(self, node: _Node, now: int) -> None:
        while node is not self.root:
            node.last_access = now
            node = node.parent_node

    # ---- locks --------------------------------------------------------------------------
    def lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_locked_tokens += len(node.tokens)
            node.lock_ref += 1
            node = node.parent_node

    def unlock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("prefix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_tokens -= len(node.tokens)
            node = node.parent_node

    # ---- eviction -----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> list[int]:
        """Frees `num_tokens` slots from unlocked leaves, least recently used first, or every
        unlocked slot when there are fewer; returns them. The last leaf loses only its tail, so a
        preempted request's prefix mostly survives the allocation that preempted it."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            num_wanted = num_tokens - len(freed)
            if len(leaf.tokens) > num_wanted:
                freed += leaf.slots[-num_wanted:]
                del leaf.tokens[-num_wanted:], leaf.slots[-num_wanted:]
                self.num_cached_tokens -= num_wanted
                break
            parent = leaf.parent_node
            del parent.children[leaf.tokens[0]]
            freed += leaf.slots
            self.num_cached_tokens -= len(leaf.tokens)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _unlocked_leaves(self) -> list[_Node]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack += node.children.values()
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _split(self, child: _Node, length: int) -> _Node:
        """Cut `child`'s edge after `length` tokens; the new upper node keeps its locks and clock."""
        parent = child.parent_node
        upper = _Node(
            child.tokens[:length],
            child.slots[:length],
            parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        parent.children[child.tokens[0]] = upper
        child.tokens, child.slots, child.parent = child.tokens[length:], child.slots[length:], upper
        upper.children[child.tokens[0]] = child
        return upper

    # ---- inspection (tests) ---------------------------------------------------------------
    def cached_slots(self) -> list[int]:
        """Every slot the tree holds (tests check ownership with it)."""
        slots, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            slots += node.slots
            stack += node.children.values()
        return slots


def _common_length(edge: list[int], tokens: list[int], start: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:] (at least 1: the caller found the
    child by its first token)."""
    n = min(len(edge), len(tokens) - start)
    if edge[:n] == tokens[start : start + n]:  # the usual case (a whole edge matches): one C compare
        return n
    return common_prefix_length(edge, tokens, start, n)


def common_prefix_length(a: list[int], b: list[int], start: int = 0, limit: int | None = None) -> int:
    """How many leading items of `a` equal b[start:], at most `limit`: slices of doubling length
    compared in C, then a Python scan of only the first slice that differs (two 4,000-token
    prompts that part near their end cost ~10 slice compares, not 4,000 Python steps)."""
    end = min(len(a), len(b) - start)
    if limit is not None:
        end = min(end, limit)
    i, step = 0, 16
    while i < end:
        stop = min(i + step, end)
        if a[i:stop] != b[start + i : start + stop]:
            while a[i] == b[start + i]:
                i += 1
            return i
        i, step = stop, 2 * step
    return max(end, 0)
