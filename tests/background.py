"""Background: a daemon thread that runs while a with-block runs (a sampler, a fake server)."""

from __future__ import annotations

import threading
from typing import Self


class Background:
    """`_run` in a daemon thread from entering the block; on leaving it, `_halt` makes `_run` return."""

    def __init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def _halt(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._halt()
        self._thread.join()
