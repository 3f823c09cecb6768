"""Replay a workload against an endpoint at one request rate and collect per-request records.

Arrivals: inter-arrival gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)); burstiness 1 is a
Poisson process, < 1 burstier, > 1 more regular. rate = inf sends everything at once. An optional
``max_concurrency`` caps requests in flight (a closed-loop client population).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np
from tqdm.asyncio import tqdm

from benchmarks.backends import BackendOptions, RequestSpec, make_session, send_request
from benchmarks.metrics import RequestRecord
from benchmarks.workload import Sample


@dataclass
class RunResult:
    request_rate: float
    max_concurrency: int | None
    start_time: float
    duration_s: float
    records: list[RequestRecord]


def arrival_offsets(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds after the start, one per request (all zero for rate = inf)."""
    if math.isinf(rate):
        return np.zeros(num_requests)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), num_requests)
    gaps[0] = 0.0  # the first request goes out at t = 0
    return np.cumsum(gaps)


async def _run(
    samples: list[Sample],
    backend: str,
    opts: BackendOptions,
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    show_progress: bool,
    label: str,
) -> RunResult:
    offsets = arrival_offsets(len(samples), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(samples), desc=label, disable=not show_progress, unit="req")

    async with make_session() as session:

        async def one(sample: Sample, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            spec = RequestSpec(sample.prompt, sample.prompt_len, sample.output_len)
            if limit is None:
                record = await send_request(session, backend, spec, opts)
            else:
                async with limit:
                    record = await send_request(session, backend, spec, opts)
            progress.update(1)
            return record

        start = time.perf_counter()
        records = await asyncio.gather(*(one(s, o) for s, o in zip(samples, offsets)))
        duration = time.perf_counter() - start
    progress.close()
    return RunResult(rate, max_concurrency, start, duration, list(records))


def run_benchmark(
    samples: list[Sample],
    backend: str,
    opts: BackendOptions,
    rate: float,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
    label: str = "",
) -> RunResult:
    return asyncio.run(
        _run(samples, backend, opts, rate, burstiness, max_concurrency, seed, show_progress, label or f"rate={rate}")
    )


def warm_up(samples: list[Sample], backend: str, opts: BackendOptions) -> RequestRecord:
    """One short request first, so compilation or lazy allocation does not land in the first run."""
    sample = samples[0]
    short = Sample(sample.prompt, sample.prompt_len, min(sample.output_len, 16))
    return run_benchmark([short], backend, opts, math.inf, show_progress=False).records[0]
