"""torch.profiler over chosen windows of forward steps, inside the running server (every rank).

Offline replays miss what the server does between steps (scheduling, sampling, the step broadcast to
the other ranks), so this profiles the real loop. Off unless TGI_PROFILE_DIR is set (vLLM spells it
VLLM_TORCH_PROFILER_DIR); TGI_PROFILE_STEPS="start:count[,start:count...]" picks the windows, counted
in forwards of this rank (default "100:20"). Each window writes, per rank:
  rank{R}-steps{S}.txt        wall time per step against GPU kernel time, the engine's named regions (`region`:
                              host time and the GPU time of the kernels each launched), and the top ops
  rank{R}-steps{S}.json.gz    its Chrome trace (chrome://tracing, ui.perfetto.dev)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)


_window_open = False  # a StepProfiler of this process is recording: `region` names ranges in it
REGIONS = ("step.build", "images.wait_preprocess", "images.encode", "step.forward", "step.sample")


_NOTHING = contextlib.nullcontext()


def region(name: str) -> contextlib.AbstractContextManager:
    """One of REGIONS, as a named range of the open profile window; outside one, a shared no-op (no RecordFunction
    on a step's path)."""
    return torch.profiler.record_function(name) if _window_open else _NOTHING


def parse_windows(spec: str) -> list[tuple[int, int]]:
    """ "100:20,400:10" -> [(100, 20), (400, 10)], sorted by start."""
    windows = []
    for part in spec.split(","):
        start, _, count = part.strip().partition(":")
        windows.append((int(start), int(count or 1)))
    if any(start < 0 or count < 1 for start, count in windows):
        raise ValueError(f"TGI_PROFILE_STEPS={spec!r}: each window is start:count with start >= 0, count >= 1")
    return sorted(windows)


class StepProfiler:
    def __init__(self, out_dir: str, windows: list[tuple[int, int]], rank: int) -> None:
        self.out_dir, self.rank = out_dir, rank
        self._windows = windows
        self._step = 0
        self._profile: torch.profiler.profile | None = None
        self._window_start = 0.0
        os.makedirs(out_dir, exist_ok=True)

    @classmethod
    def from_env(cls, rank: int) -> StepProfiler | None:
        out_dir = os.environ.get("TGI_PROFILE_DIR") or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not out_dir:
            return None
        windows = parse_windows(os.environ.get("TGI_PROFILE_STEPS", "100:20"))
        logger.warning("rank %d: profiling forward steps %s into %s", rank, windows, out_dir)
        return cls(out_dir, windows, rank)

    def before_step(self) -> None:
        """Call at the start of every forward: opens and closes the windows."""
        if self._windows and self._profile is None and self._step == self._windows[0][0]:
            self._open()
        elif self._profile is not None and self._step == self._windows[0][0] + self._windows[0][1]:
            self._close()
        self._step += 1

    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        self._window_start = time.perf_counter()
        _set_window_open(True)

    def _close(self) -> None:
        assert self._profile is not None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._window_start
        _set_window_open(False)
        self._profile.__exit__(None, None, None)
        start, count = self._windows.pop(0)
        stem = os.path.join(self.out_dir, f"rank{self.rank}-steps{start}")
        self._write_summary(stem + ".txt", start, count, wall)
        self._profile.export_chrome_trace(stem + ".json.gz")  # torch gzips a path ending in .gz
        self._profile = None
        logger.warning("rank %d: wrote the profile of steps %d..%d to %s.*", self.rank, start, start + count, stem)

    def _write_summary(self, path: str, start: int, count: int, wall_s: float) -> None:
        assert self._profile is not None
        events = self._profile.key_averages()
        device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(path, "w") as f:
            f.write(
                f"rank {self.rank}, forward steps {start}..{start + count}: wall {1e3 * wall_s / count:.3f} ms/step, "
                f"GPU kernels {device_us / 1e3 / count:.3f} ms/step\n\n"
            )
            f.write("region                      calls   host ms/step   GPU ms/step (kernels it launched)\n")
            for event in events:
                if event.key in REGIONS:
                    f.write(
                        f"{event.key:<26} {event.count:>6} {event.cpu_time_total / 1e3 / count:>14.3f} "
                        f"{event.device_time_total / 1e3 / count:>13.3f}\n"
                    )
            f.write("\n")
            f.write(events.table(sort_by=sort_by, row_limit=40, max_name_column_width=90))


def _set_window_open(value: bool) -> None:
    global _window_open
    _window_open = value
