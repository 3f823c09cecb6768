"""The stall sampler (TGI_STALL_TRACE_MS): a slow turn logs where its threads were; a quick one logs nothing."""

from __future__ import annotations

import logging
import threading
import time

from tgi_compat.router.stall_sampler import StallSampler


def _held_up_in_the_turn(seconds: float) -> None:
    time.sleep(seconds)


def _side_thread_work(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(1e-3)


def test_a_slow_turn_logs_the_stacks_of_its_threads(caplog):
    sampler = StallSampler(threshold_s=0.05)
    stop = threading.Event()
    side = threading.Thread(target=_side_thread_work, args=(stop,), name="side-reader")
    side.start()
    try:
        with caplog.at_level(logging.WARNING, logger="tgi_compat.router.stall_sampler"):
            with sampler.turn():
                _held_up_in_the_turn(0.001)
            assert not caplog.records  # under the threshold
            with sampler.turn():
                _held_up_in_the_turn(0.3)  # ~275 samples past 25 ms: some even on a loaded machine
    finally:
        stop.set()
        side.join()
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith("engine turn took ")
    assert "_held_up_in_the_turn" in text  # the turn's own thread, where it was held up
    assert "side-reader" in text and "_side_thread_work" in text
