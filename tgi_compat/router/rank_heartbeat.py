"""Tensor-parallel ranks that hang, noticed within seconds.

A rank that dies is seen at once (its process sentinel, tgi_compat.router.client). One that hangs without dying
would stall every rank in the next collective, and only the health probe's timeout would notice.
So each rank publishes two numbers in a small shared-memory array, and the API process, which
watches the processes anyway, checks them twice a second (HangWatch):

- a beat: a daemon thread writes the time every BEAT_INTERVAL_S. A rank silent for HANG_TIMEOUT_S
  cannot run at all (stopped, frozen, stuck with the GIL held);
- its step count: steps rank 0 has sent, steps each other rank has taken up. A rank whose main
  thread is stuck (a wedged device call) still beats, but stays behind rank 0's count; behind and
  unmoved for HANG_TIMEOUT_S, it is hung. Healthy ranks take each step up as soon as they finish
  the one before, which the collectives keep in step with rank 0's.

Either way the engine is declared dead: /health answers 503 and the server exits non-zero, or the
ranks restart under --health-monitor. A rank waiting in a collective for a stuck peer beats and is
not behind: the stuck rank is the one named. All of it runs only under --num-shard > 1.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import threading
import time

BEAT_INTERVAL_S = 0.5
# A healthy rank may hold the GIL for a while (a Triton compile, a large host copy) or spend a
# while in one long step: the timeout is many beats long. TGI_RANK_HANG_TIMEOUT_S overrides it.
HANG_TIMEOUT_S = 10.0
HANG_TIMEOUT_ENV = "TGI_RANK_HANG_TIMEOUT_S"


def hang_timeout_s() -> float:
    return float(os.environ.get(HANG_TIMEOUT_ENV, HANG_TIMEOUT_S))


class RankHeartbeats:
    """Per rank: the time.monotonic() of its last beat (system-wide on Linux, so comparable across
    processes) and its step count. Made by the API process, passed to each rank at spawn."""

    def __init__(self, num_ranks: int) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.beats = spawn.RawArray(ctypes.c_double, num_ranks)
        self.steps = spawn.RawArray(ctypes.c_int64, num_ranks)

    @property
    def num_ranks(self) -> int:
        return len(self.beats)

    def start_beating(self, rank: int) -> None:
        """In rank `rank`'s process: beat from a daemon thread until the process ends."""

        def beat() -> None:
            while True:
                self.beats[rank] = time.monotonic()
                time.sleep(BEAT_INTERVAL_S)

        threading.Thread(target=beat, name=f"rank-{rank}-heartbeat", daemon=True).start()

    def step_counter(self, rank: int):
        """In rank `rank`'s process: a function to call once per step sent (rank 0) or taken up."""
        steps = self.steps

        def count_step() -> None:
            steps[rank] += 1  # one writer per slot: no lock

        return count_step


class HangWatch:
    """The API process's side: `check()` names a hung rank, or returns None."""

    def __init__(self, heartbeats: RankHeartbeats, timeout_s: float, now: float) -> None:
        self.heartbeats = heartbeats
        self.timeout_s = timeout_s
        # Beats and steps before the watch began count as made then: a rank that was busy loading
        # the model while the others waited is not hung.
        self.started = now
        self._behind_since: dict[int, tuple[int, float]] = {}  # rank -> (its step count, since when)

    def check(self, now: float) -> str | None:
        for rank in range(self.heartbeats.num_ranks):
            silent_s = now - max(self.heartbeats.beats[rank], self.started)
            if silent_s > self.timeout_s:
                return f"{_name(rank)} is hung: no heartbeat for {silent_s:.1f} s"
        sent = self.heartbeats.steps[0]
        for rank in range(1, self.heartbeats.num_ranks):
            taken = self.heartbeats.steps[rank]
            if taken >= sent:
                self._behind_since.pop(rank, None)
                continue
            count, since = self._behind_since.setdefault(rank, (taken, now))
            if count != taken:  # behind, but moving
                self._behind_since[rank] = (taken, now)
            elif now - since > self.timeout_s:
                return f"{_name(rank)} is hung: step {taken + 1} not taken up for {now - since:.1f} s"
        return None


def _name(rank: int) -> str:
    return "engine process (rank 0)" if rank == 0 else f"tensor-parallel tp-rank-{rank} process"
