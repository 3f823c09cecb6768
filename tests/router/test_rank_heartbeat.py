"""The hang watch of tensor-parallel ranks (tgi_compat.router.rank_heartbeat): which rank it names and when.

Times are given, not slept: the watch reads beats and step counts from the shared arrays and the
`now` it is passed. (The end-to-end case, a SIGSTOPped rank of a real 2-rank server, is in
integration-tests/test_tensor_parallel_server.py.)"""

from __future__ import annotations

import time

from tgi_compat.router.rank_heartbeat import HANG_TIMEOUT_ENV, HangWatch, RankHeartbeats, hang_timeout_s

TIMEOUT_S = 10.0


def _watch(num_ranks: int = 3) -> tuple[RankHeartbeats, HangWatch]:
    heartbeats = RankHeartbeats(num_ranks)
    return heartbeats, HangWatch(heartbeats, TIMEOUT_S, now=100.0)


def test_the_timeout_is_the_readmes_10_s_unless_the_environment_sets_it(monkeypatch):
    monkeypatch.delenv(HANG_TIMEOUT_ENV, raising=False)
    assert hang_timeout_s() == 10.0
    monkeypatch.setenv(HANG_TIMEOUT_ENV, "4.5")  # (the end-to-end test's server sets it short)
    assert hang_timeout_s() == 4.5


def test_ranks_that_beat_and_keep_up_are_not_hung():
    heartbeats, watch = _watch()
    for now in (101.0, 130.0, 200.0):
        for rank in range(3):
            heartbeats.beats[rank] = now - 1.0
            heartbeats.steps[rank] += 5  # rank 0 sent 5 steps, each other rank took them up
        assert watch.check(now) is None


def test_a_silent_rank_is_named_after_the_timeout_counted_from_the_start_of_the_watch():
    heartbeats, watch = _watch()
    heartbeats.beats[0] = heartbeats.beats[1] = 109.0
    heartbeats.beats[2] = 50.0  # last beat before the watch began: counts as made at 100
    assert watch.check(109.0) is None
    heartbeats.beats[0] = heartbeats.beats[1] = 110.5
    assert watch.check(110.5) == "tensor-parallel tp-rank-2 process is hung: no heartbeat for 10.5 s"


def test_a_rank_that_beats_but_stays_behind_rank_zero_is_named():
    heartbeats, watch = _watch()
    heartbeats.steps[0], heartbeats.steps[1], heartbeats.steps[2] = 8, 8, 7  # rank 2 has not taken step 8
    for now in (101.0, 105.0, 111.0):
        for rank in range(3):
            heartbeats.beats[rank] = now
        assert watch.check(now) is None  # behind since 101: not yet 10 s
    for rank in range(3):
        heartbeats.beats[rank] = 111.5
    assert watch.check(111.5) == "tensor-parallel tp-rank-2 process is hung: step 8 not taken up for 10.5 s"


def test_a_rank_behind_but_moving_is_not_hung():
    heartbeats, watch = _watch(num_ranks=2)
    heartbeats.steps[0] = 100
    for now in range(101, 140):  # one step behind all the time, but taking a step up every second
        heartbeats.beats[0] = heartbeats.beats[1] = float(now)
        heartbeats.steps[0] += 1
        heartbeats.steps[1] = heartbeats.steps[0] - 1
        assert watch.check(float(now)) is None


def test_the_beating_thread_writes_the_time_into_its_slot():
    heartbeats = RankHeartbeats(2)
    before = time.monotonic()
    heartbeats.start_beating(1)
    deadline = time.monotonic() + 5
    while heartbeats.beats[1] < before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heartbeats.beats[1] >= before and heartbeats.beats[0] == 0.0
    count = heartbeats.step_counter(1)
    count()
    count()
    assert list(heartbeats.steps) == [0, 2]
