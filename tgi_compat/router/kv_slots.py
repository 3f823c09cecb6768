"""Slot numbers of the token-granular KV cache (LightLLM's Token Attention), and request rows.

The router owns the *numbers*; the ModelRunner owns the tensors. One slot holds the K/V of one
token in every layer, so a request needs exactly as many slots as tokens it has run: no pages, no
fragmentation. A row is a request's line in the runner's `req_to_token[row, position] -> slot`
table; the runner writes `out_slots` into it during forward.

Both free lists are host stacks (LightLLM v1 keeps its free list on the host too): allocation is a
slice, freeing is an extend, and neither touches the device.

With prefix caching (tgi_compat/router/prefix_cache.py) a slot is in exactly one of three places: the free
list, the tree, or a running request's private tail. Slots in unlocked tree leaves count as free:
allocation evicts them (least recently used first) before it ever reports the pool full, so the
scheduler preempts only when the free list and the evictable cache together are short.
"""

from __future__ import annotations

from tgi_compat.router.prefix_cache import PrefixCache, PrefixMatch

# An eviction walks the whole tree, so it frees at least this share of the pool: with the tree full
# (a long-running server) the walk is paid once every many steps, not at every allocation.
EVICTION_BATCH_FRACTION = 1 / 64


class KVSlotPool:
    def __init__(self, num_slots: int, num_rows: int, prefix_caching: bool = False) -> None:
        if num_slots <= 0 or num_rows <= 0:
            raise ValueError(f"need slots and rows, got num_slots={num_slots} num_rows={num_rows}")
        self.num_slots = num_slots
        self.num_rows = num_rows
        # Reversed so that pops hand out low numbers first (easier to read in tests and dumps).
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))
        self.prefix_cache: PrefixCache | None = PrefixCache() if prefix_caching else None
        self._eviction_batch = max(1, int(num_slots * EVICTION_BATCH_FRACTION))
        self.num_prefix_queried_tokens = 0  # cumulative, for vllm:prefix_cache_queries_total
        self.num_prefix_hit_tokens = 0  # cumulative, for vllm:prefix_cache_hits_total

    @property
    def num_free_slots(self) -> int:
        """Free slots, the evictable cached ones included."""
        if self.prefix_cache is None:
            return len(self._free_slots)
        return len(self._free_slots) + self.prefix_cache.num_evictable_tokens

    @property
    def num_used_slots(self) -> int:
        """Slots running requests hold (the evictable cache is not in use)."""
        return self.num_slots - self.num_free_slots

    @property
    def num_shared_slots(self) -> int:
        """Cached slots that running requests lock: each is held once however many share it."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_locked_tokens

    def is_full_free(self) -> bool:
        """True when every slot and row is back in the pool, the unlocked cache counting as free
        (tests assert this after each run)."""
        return self.num_free_slots == self.num_slots and len(self._free_rows) == self.num_rows

    def allocate(self, num_tokens: int) -> list[int] | None:
        """`num_tokens` slot numbers, or None when the pool cannot hold them (the caller preempts)."""
        if num_tokens > len(self._free_slots):
            if num_tokens > self.num_free_slots:
                return None
            self._free_slots += self._cache.evict(max(num_tokens - len(self._free_slots), self._eviction_batch))
        if num_tokens == 0:
            return []
        taken = self._free_slots[-num_tokens:]
        del self._free_slots[-num_tokens:]
        return taken

    def free(self, slots: list[int]) -> None:
        self._free_slots.extend(slots)

    def allocate_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    # ---- prefix caching (only called when self.prefix_cache is set) ----------------------
    @property
    def _cache(self) -> PrefixCache:
        assert self.prefix_cache is not None, "prefix caching is off"
        return self.prefix_cache

    def take_cached_prefix(self, tokens: list[int]) -> PrefixMatch | None:
        """The longest cached prefix of `tokens`, locked for the caller, or None on a miss."""
        self.num_prefix_queried_tokens += len(tokens)
        match = self._cache.match(tokens)
        if not match.slots:
            return None
        self._cache.lock(match.node)
        self.num_prefix_hit_tokens += match.num_tokens
        return match

    def release_cached_prefix(self, prefix: PrefixMatch | None) -> None:
        if prefix is not None:
            self._cache.unlock(prefix.node)

    def cache_and_free(self, tokens: list[int], slots: list[int], prefix: PrefixMatch | None) -> None:
        """A request gives its slots back: `tokens` (the leading ones whose K/V is written, at
        least its locked `prefix`) go into the tree, every other slot to the free list."""
        num_locked = 0 if prefix is None else prefix.num_tokens
        if len(tokens) < num_locked:
            raise ValueError(f"{len(tokens)} tokens to cache, fewer than the {num_locked} locked")
        num_present, _ = self._cache.insert(tokens, slots[: len(tokens)], prefix)
        self._free_slots += slots[num_locked:num_present]  # duplicates of what someone else cached
        self._free_slots += slots[len(tokens) :]  # K/V never written by a completed step
        self.release_cached_prefix(prefix)

    def share_running(self, tokens: list[int], slots: list[int], prefix: PrefixMatch | None) -> PrefixMatch | None:
        """Cache the written `tokens` of a running request (its prompt once prefilled, so that
        requests sharing it hit while it still runs). Returns the request's new locked prefix.

        Only when no one cached part of its private tail meanwhile: the tree would then hold other
        slots for those tokens while the request's row still points at its own."""
        num_locked = 0 if prefix is None else prefix.num_tokens
        cache = self._cache
        if len(tokens) <= num_locked or cache.extends_past(prefix, tokens[num_locked]):
            return prefix
        shared = slots[: len(tokens)]
        _, node = cache.insert(tokens, shared, prefix)
        cache.lock(node)
        self.release_cached_prefix(prefix)
        return PrefixMatch(shared, node)

    def flush_prefix_cache(self) -> None:
        """Evict every unlocked cached slot to the free list."""
        if self.prefix_cache is not None:
            self._free_slots += self.prefix_cache.evict(self.prefix_cache.num_evictable_tokens)
