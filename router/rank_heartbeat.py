"""Tensor-parallel ranks that hang, noticed within seconds.

A rank that dies is seen at once (its process sentinel, router.client). One that hangs without dying
(stopped, frozen, stuck with the GIL held) would stall every rank in the next collective, and only
the health probe's timeout would notice. So each rank process beats: a daemon thread writes the
time into the rank's slot of a small shared-memory array every BEAT_INTERVAL_S, and the API process,
which watches the processes anyway, declares the engine dead when a slot is older than
HANG_TIMEOUT_S (then /health answers 503 and the server exits non-zero, or restarts the ranks
under --health-monitor). A rank waiting in a collective for a slow peer still beats: only the rank
that cannot run at all goes stale, and it is the one named.

The beat runs only under --num-shard > 1; one thread waking twice a second costs nothing measurable.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

BEAT_INTERVAL_S = 0.5
# A healthy rank may hold the GIL for a while (a Triton compile, a large host copy): the timeout
# is many beats long. TGI_RANK_HANG_TIMEOUT_S overrides it.
HANG_TIMEOUT_S = 10.0
HANG_TIMEOUT_ENV = "TGI_RANK_HANG_TIMEOUT_S"


def hang_timeout_s() -> float:
    return float(os.environ.get(HANG_TIMEOUT_ENV, HANG_TIMEOUT_S))


@dataclass(frozen=True, slots=True)
class StaleRank:
    rank: int
    silent_s: float  # seconds since its last beat


class RankHeartbeats:
    """One slot per rank: the time.monotonic() of its last beat (system-wide on Linux, so
    comparable across processes). Made by the API process, passed to each rank at spawn."""

    def __init__(self, num_ranks: int) -> None:
        self.slots = multiprocessing.get_context("spawn").RawArray(ctypes.c_double, num_ranks)

    def start_beating(self, rank: int) -> None:
        """In rank `rank`'s process: beat from a daemon thread until the process ends."""

        def beat() -> None:
            while True:
                self.slots[rank] = time.monotonic()
                time.sleep(BEAT_INTERVAL_S)

        threading.Thread(target=beat, name=f"rank-{rank}-heartbeat", daemon=True).start()

    def stalest(self, watching_since: float) -> StaleRank:
        """The rank silent the longest; beats before `watching_since` count as made then (a rank
        busy loading the model while the others wait is not hung)."""
        now = time.monotonic()
        ages = [now - max(beat, watching_since) for beat in self.slots]
        rank = max(range(len(ages)), key=ages.__getitem__)
        return StaleRank(rank, ages[rank])
