"""Which adapter sits in which of the --max-loras device slots (the router owns the numbers, modeling the tensors).

A running request holds its adapter's slot; a slot no running request holds keeps its adapter (a later request
for it needs no copy) until another adapter needs the room, least recently used first. A request whose adapter
finds no slot waits, as one that finds no KV slots does.
"""

from __future__ import annotations

import itertools


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.adapters: list[int] = [0] * max_loras  # adapter id in each slot, 0: empty
        self.holders = [0] * max_loras  # running requests on each slot
        self._last_use = [0] * max_loras
        self._clock = itertools.count(1)

    @property
    def num_slots(self) -> int:
        return len(self.adapters)

    def acquire(self, adapter_id: int) -> tuple[int, bool] | None:
        """(slot, whether the adapter must be copied there), or None while every slot is held by other adapters."""
        if adapter_id in self.adapters:
            slot, is_new = self.adapters.index(adapter_id), False
        else:
            free = [s for s, held in enumerate(self.holders) if held == 0]
            if not free:
                return None
            slot, is_new = min(free, key=self._last_use.__getitem__), True
            self.adapters[slot] = adapter_id
        self.holders[slot] += 1
        self._last_use[slot] = next(self._clock)
        return slot, is_new

    def release(self, slot: int) -> None:
        self.holders[slot] -= 1

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter's idle slot is empty again (a held one empties when its last request leaves)."""
        if adapter_id in self.adapters:
            slot = self.adapters.index(adapter_id)
            if self.holders[slot] == 0:
                self.adapters[slot] = 0
