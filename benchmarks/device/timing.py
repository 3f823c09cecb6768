"""How the device benchmarks time GPU work, in one place.

Bandwidths are quoted against a measured device-to-device copy (bytes read + written), so "% of copy
bandwidth" means the same in every benchmark. Kernel times come from CUDA-graph replays, so no host launch
cost is in the number: `graph_ms` is the median of `triton.testing.do_bench` (L2 flushed before each replay),
`replay_us` the mean over replays of one graph holding many calls (each call on its own weight copy, so that
every call reads HBM as a layer of a real step does).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable

import torch
import triton


def log(msg: str) -> None:
    print(msg, flush=True)


def out_path(name: str) -> str:
    """Where a benchmark writes its results by default: $OUT (what the device machine brings back) or here."""
    return os.path.join(os.environ.get("OUT", "."), name)


def write_json(path: str, report: object) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def device_info(bandwidth: float) -> dict:
    """What a result needs beside it: the GPU, the software and the copy bandwidth it is quoted against."""
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    return dict(
        gpu=torch.cuda.get_device_name(),
        sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        copy_bw_gbs=bandwidth / 1e9,
    )


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, read + write counted (eager: a copy captured in a graph
    read 2,709 GB/s on an H200)."""
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16).repeat(2)
    dst = torch.empty_like(src)
    ms = median_ms(functools.partial(dst.copy_, src))
    return 2 * 2**31 / (ms * 1e-3)


def pct_of(bandwidth: float, moved_bytes: float, ms: float) -> float:
    """`moved_bytes` in `ms` as % of `bandwidth` (bytes/s)."""
    return 100 * moved_bytes / (ms * 1e-3) / bandwidth


def graph_ms(fn: Callable[[], object], calls: int = 1, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of one call of fn, from do_bench over replays of a graph holding `calls` calls of it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, warmup, rep) / calls


def replay_us(calls: list[Callable[[], object]], reps: int = 20, warm_replays: int = 1) -> float:
    """Mean us per call over `reps` replays of one graph holding every call, timed with CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # first launches (compiles, autotuning) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warm_replays):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps / len(calls)


Timer = Callable[[Callable[[], object]], float]


def timer(device: str, reps: int) -> Timer:
    """ms per call: CUDA events around `reps` calls after two warm-up calls (compiles, autotuning, allocator)."""

    def cuda_ms(fn: Callable[[], object]) -> float:
        fn()
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def wall_ms(fn: Callable[[], object]) -> float:  # the smoke run: one call
        begin = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - begin)

    return cuda_ms if device == "cuda" else wall_ms
