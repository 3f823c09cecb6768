"""A step's host <-> device copies on side streams.

On the compute stream a copy starts only once the kernels queued before it are done, and the kernels queued
after it start only once it is done: each hand-over between the SMs and a copy engine costs several
microseconds, on the critical path between two forwards. On side streams the next batch's indices, uploaded
while the GPU still runs the step before, are on the device long before the compute stream reaches them, and
the compute stream goes on to the next forward while the sampled ids travel to the host (H200 profiles of
64-row decoding: 56 -> ~20 us between two forwards on one GPU, 64 -> 31 us on two; BENCHMARKS.md, fourteenth
session).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _side_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    # one stream a direction: a download waits for the step's sampling, which an upload must not wait behind
    return torch.cuda.Stream(device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (pinned, on a GPU) on `device`, ready for whatever the current stream queues next."""
    if device.type != "cuda":
        return host.to(device)
    compute = torch.cuda.current_stream(device)
    side = _side_stream(device, "up")
    with torch.cuda.stream(side):
        out = host.to(device, non_blocking=True)
    compute.wait_stream(side)
    out.record_stream(compute)  # its memory returns to the pool only once the compute stream is done with it
    return out


def download(values: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event:
    """Copy `values` (on a GPU) into pinned `host` once the current stream's work so far is done; the
    returned event marks the copy's end."""
    compute = torch.cuda.current_stream(values.device)
    side = _side_stream(values.device, "down")
    side.wait_stream(compute)
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        host.copy_(values, non_blocking=True)
        done.record(side)
    values.record_stream(side)
    return done
