"""Programmatic dependent launch (PDL): whether the decode-step kernels use it.

On Hopper and newer a kernel launched with `launch_pdl=True` may start while the kernel before it in
the stream is finishing; it must `gdc_wait()` before reading anything that kernel (or any earlier
one) wrote. The chain of small decode kernels (GEMVs, rotary + KV store, flash-decoding stages) uses
it to hide each launch's latency behind the previous kernel's tail; CUDA graphs keep the edges.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _device_supports_pdl(device: torch.device) -> bool:
    return os.environ.get("TGI_COMPAT_PDL", "1") != "0" and torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(tensor: torch.Tensor) -> bool:
    """True when kernels launched on `tensor`'s device should use PDL (TGI_COMPAT_PDL=0: never)."""
    return tensor.is_cuda and _device_supports_pdl(tensor.device)


def use_pdl_for_one_request(tensor: torch.Tensor, num_requests: int) -> bool:
    """PDL for the attention-side kernels and the RMSNorm only at batch 1. H200, Llama-3-8B decode steps
    (BENCHMARKS.md run I): batch 1 4.25 -> 4.10 ms with every decode kernel dependent-launched, but batch 8
    4.91 -> 5.04 ms (its flash-decoding grid is two waves: early-launched stage-2 programs take SM slots).
    The RMSNorm: W4A16's one-row GEMVs run their norms as their own kernels (2.570 -> 2.486 ms a step on an
    H100, thirteenth session)."""
    return num_requests == 1 and use_pdl(tensor)


def launch_options(enabled: bool) -> dict:
    """The launch keyword for a PDL launch (omitted otherwise: Triton's interpreter does not know it)."""
    return {"launch_pdl": True} if enabled else {}
