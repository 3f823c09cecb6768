"""Where a slow turn of the engine loop goes: with TGI_STALL_TRACE_MS=N set, a thread samples every thread's Python
stack each millisecond of a turn that has run past N/2 ms, and a turn that ends past N ms logs the stacks it caught
most often, thread by thread. For the one-off stalls that a profiler window (TGI_PROFILE_STEPS) rarely lands on:
an adapter load's, an image's. The sampler needs the GIL too: its longest wait between two samples says how long
some thread held it."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import FrameType

logger = logging.getLogger(__name__)
ENV = "TGI_STALL_TRACE_MS"
STACK_DEPTH = 8  # innermost frames kept per sample
SHOWN = 3  # stacks logged per thread


def _stack(frame: FrameType | None) -> tuple[str, ...]:
    out: list[str] = []
    while frame is not None and len(out) < STACK_DEPTH:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(out)


class StallSampler:
    def __init__(self, threshold_s: float, interval_s: float = 1e-3) -> None:
        self.threshold_s, self.interval_s = threshold_s, interval_s
        self._lock = threading.Lock()
        self._began: float | None = None
        self._samples: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self._longest_wait_s = 0.0
        threading.Thread(target=self._run, name="stall-sampler", daemon=True).start()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        began = time.perf_counter()
        with self._lock:
            self._began, self._samples, self._longest_wait_s = began, Counter(), 0.0
        try:
            yield
        finally:
            with self._lock:
                samples, longest_wait_s = self._samples, self._longest_wait_s
                self._began = None
            elapsed = time.perf_counter() - began
            if elapsed > self.threshold_s:
                self._log(elapsed, samples, longest_wait_s)

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while True:
            time.sleep(self.interval_s)
            now = time.perf_counter()
            with self._lock:
                began = self._began
            if began is None or now - began < self.threshold_s / 2:
                last = now
                continue
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            # stacks as strings at once: a frame kept until the next sample keeps its locals alive (an engine the
            # caller has deleted, whose memory the next one needs)
            stacks = [
                (names.get(ident, str(ident)), _stack(frame))
                for ident, frame in sys._current_frames().items()
                if ident != me
            ]
            with self._lock:
                if self._began == began:
                    self._longest_wait_s = max(self._longest_wait_s, now - last)
                    self._samples.update(stacks)
            last = now

    def _log(self, elapsed: float, samples: Counter[tuple[str, tuple[str, ...]]], longest_wait_s: float) -> None:
        by_thread: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
        for (thread, stack), count in samples.most_common():
            by_thread.setdefault(thread, []).append((count, stack))
        lines = [
            f"engine turn took {1e3 * elapsed:.0f} ms; samples past {0.5e3 * self.threshold_s:.0f} ms "
            f"(the sampler's longest wait {1e3 * longest_wait_s:.0f} ms):"
        ]
        for thread, stacks in by_thread.items():
            total = sum(count for count, _ in stacks)
            lines.append(f"  {thread}: {total} samples")
            for count, stack in stacks[:SHOWN]:
                lines.append(f"    {count:5d}x " + " < ".join(stack))
        logger.warning("\n".join(lines))


@functools.cache
def stall_sampler_from_env() -> StallSampler | None:
    """The process's one sampler (its thread runs for good), where TGI_STALL_TRACE_MS is set."""
    value = os.environ.get(ENV)
    if not value:
        return None
    logger.warning("%s=%s: logging where engine turns longer than %s ms go", ENV, value, value)
    return StallSampler(float(value) / 1e3)
