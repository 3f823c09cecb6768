"""`--max-concurrent-requests`: permits taken without waiting (TGI answers 429 at once).

`best_of=n` takes n permits, all or none. Runs on the event loop thread only, so a plain counter
is enough.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tgi_compat.api.protocol.errors import overloaded_error


class PermitPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._in_use = 0

    @property
    def available(self) -> int:
        return self.capacity - self._in_use

    def try_acquire(self, count: int = 1) -> bool:
        if count > self.available:
            return False
        self._in_use += count
        return True

    def release(self, count: int = 1) -> None:
        self._in_use -= count

    @contextmanager
    def hold(self, count: int = 1) -> Iterator[None]:
        """Take `count` permits for the block, or raise TGI's overloaded error."""
        if not self.try_acquire(count):
            raise overloaded_error()
        try:
            yield
        finally:
            self.release(count)
