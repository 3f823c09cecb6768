"""Slot numbers of the token-granular KV cache (LightLLM's Token Attention), and request rows.

The router owns the *numbers*; the ModelRunner owns the tensors. One slot holds the K/V of one
token in every layer, so a request needs exactly as many slots as tokens it has run: no pages, no
fragmentation. A row is a request's line in the runner's `req_to_token[row, position] -> slot`
table; the runner writes `out_slots` into it during forward.

Both free lists are host stacks (LightLLM v1 keeps its free list on the host too): allocation is a
slice, freeing is an extend, and neither touches the device.
"""

from __future__ import annotations


class KVSlotPool:
    def __init__(self, num_slots: int, num_rows: int) -> None:
        if num_slots <= 0 or num_rows <= 0:
            raise ValueError(f"need slots and rows, got num_slots={num_slots} num_rows={num_rows}")
        self.num_slots = num_slots
        self.num_rows = num_rows
        # Reversed so that pops hand out low numbers first (easier to read in tests and dumps).
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    def is_full_free(self) -> bool:
        """True when every slot and row is back in the pool (tests assert this after each run)."""
        return len(self._free_slots) == self.num_slots and len(self._free_rows) == self.num_rows

    def allocate(self, num_tokens: int) -> list[int] | None:
        """`num_tokens` slot numbers, or None when the pool cannot hold them (the caller preempts)."""
        if num_tokens > len(self._free_slots):
            return None
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
