"""The next projection's weight pulled into L2 while a tensor-parallel all-reduce runs.

A sharded decode step's fused all-reduce + RMSNorm takes ~4.5 us at 64 rows and leaves HBM idle; the GEMM after
it reads a weight from HBM. Prefetching the weight's first 8 MiB on a side stream meanwhile (tgi_compat.kernels.comm.l2_prefetch)
shortens a two-shard Llama-3-8B decode step on H200s by 0.4-3.1% at 8-96 rows (64 rows: 3.454 -> 3.361 ms; bench_tp,
BENCHMARKS.md, fifteenth session). At 128 rows it cost 2.8% and at 256 rows 31%, for reasons not found: hence
PREFETCH_MAX_ROWS. It is not done beside one GPU's norms (2 us: no idle window; it cost 1% there), nor beside
attention, whose KV reads it slows more than the o projection gains (scripts/device/probe_l2_prefetch.py on the
branch l2-prefetch-probe). The fork and join are graph-capture safe.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from tgi_compat.kernels.comm.l2_prefetch import l2_prefetch, supports_l2_prefetch

PREFETCH_BYTES = 8 << 20  # 8 and 16 MiB measured the same: about what the all-reduce's window lets arrive
PREFETCH_MAX_ROWS = 96  # the widest measured gain (128 and 256 rows lost)


@functools.cache
def _prefetch_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def weight_prefetched_beside(weight: torch.Tensor | None, rows: int) -> Iterator[None]:
    """While the block runs its (latency-bound) kernels on the current stream, `weight`'s first bytes travel to L2 on
    a side stream, which the current stream waits for at the end of the block. No-op where the weight is not a plain
    CUDA tensor on a device with the bulk prefetch, or the GEMM that reads it is compute-bound (`rows`)."""
    if weight is None or rows > PREFETCH_MAX_ROWS or not supports_l2_prefetch(weight.device):
        yield
        return
    current = torch.cuda.current_stream(weight.device)
    side = _prefetch_stream(weight.device)
    side.wait_stream(current)  # forks from the current stream (a CUDA graph's capture follows it)
    with torch.cuda.stream(side):
        l2_prefetch(weight, PREFETCH_BYTES)
    yield
    current.wait_stream(side)
