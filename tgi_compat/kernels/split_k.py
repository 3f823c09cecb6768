"""Scratch for kernels that split K over several programs (the int4 GEMVs, the FP8 GEMM): each program parks its
partial sums, counts itself in on its column's counter, and the last one adds them and resets the counter."""

from __future__ import annotations

import torch

_MAX_SPLIT_K_COLUMNS = 1 << 17
_split_k_counters: dict[torch.device, torch.Tensor] = {}


def split_k_scratch(
    x: torch.Tensor, programs: int, split_k: int, floats_a_program: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K launch's fp32 partial sums and its column counters (x stands in for both at split_k 1)."""
    if split_k == 1:
        return x, x
    partial = torch.empty(programs * split_k * floats_a_program, dtype=torch.float32, device=x.device)
    return partial, split_k_counters(x.device, programs)


def split_k_counters(device: torch.device, columns: int) -> torch.Tensor:
    """The device's split-K counters (int32, zero between launches: the last program of a column resets its
    counter). One buffer for the device's life, never reallocated, as CUDA graphs keep its address; the
    kernels using it run one at a time on the device's stream (each waits for the one before, PDL included)."""
    assert columns <= _MAX_SPLIT_K_COLUMNS, f"{columns} programs along N: raise block_n"
    counters = _split_k_counters.get(device)
    if counters is None:
        counters = _split_k_counters[device] = torch.zeros(_MAX_SPLIT_K_COLUMNS, dtype=torch.int32, device=device)
    return counters
