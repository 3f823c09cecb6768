"""Adapters copied into their device slots off the step's stream.

A staged adapter (pinned host tensors, one per slot buffer: tgi_compat.modeling.lora.weights.LoraWeights.stage) is
copied on a side CUDA stream; the step stream waits on an event recorded after the copies, so the slot is live for
the first step that reads it and no step before waits for the copy. The side stream first waits for the work
already queued on the step stream: a step still in flight may read the slot's previous adapter. On the CPU the
copies simply run in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tgi_compat.modeling.lora.weights import LoraWeights

Staged = Sequence[tuple[LoraWeights, tuple[torch.Tensor, torch.Tensor]]]


# Page-locking takes the driver's lock, which the serving thread's launches need too, and torch holds the GIL for
# the call. While one 84 MB buffer (Llama-3-8B, r = 16) was locked, the longest gap between two tokens of 64 streams
# grew by 128 ms (H100, session 26; the suspect, not profiled). A buffer of a few MB holds both for a few ms at a
# time; one per tensor (256) was a driver call each.
PIN_CHUNK_BYTES = 4 << 20


def pinned(staged: Staged, device: torch.device) -> Staged:
    """A staged adapter in pinned host memory beside a GPU model, so that `place` is one asynchronous copy per
    tensor: its tensors packed in order into a few pinned buffers of about PIN_CHUNK_BYTES each."""
    if device.type != "cuda" or not staged:
        return staged
    dtype = staged[0][1][0].dtype  # (every slot buffer is in the model's dtype)
    sizes = chunk_sizes([t.numel() for _, pair in staged for t in pair], PIN_CHUNK_BYTES // dtype.itemsize)
    # this GPU's context (a reader thread's current device is GPU 0, whatever the rank's)
    with torch.cuda.device(device):
        buffers = [torch.empty(size, dtype=dtype, pin_memory=True) for size in sizes]
    return pack(staged, buffers)


def chunk_sizes(numels: Sequence[int], limit: int) -> list[int]:
    """Consecutive tensors' sizes grouped into buffers of at most `limit` elements (a larger tensor: one of its own)."""
    sizes: list[int] = []
    for numel in numels:
        if sizes and sizes[-1] + numel <= limit:
            sizes[-1] += numel
        else:
            sizes.append(numel)
    return sizes


def pack(staged: Staged, buffers: Sequence[torch.Tensor]) -> Staged:
    """`staged` copied into consecutive views of the flat `buffers`, in order (each filled exactly before the next)."""
    out, chunks = [], iter(buffers)
    buffer, offset = next(chunks), 0
    for weights, pair in staged:
        views = []
        for tensor in pair:
            assert tensor.dtype == buffer.dtype, (tensor.dtype, buffer.dtype)
            if offset + tensor.numel() > buffer.numel():  # the next buffer's first tensor: this one is full
                assert offset == buffer.numel(), (offset, buffer.numel())
                buffer, offset = next(chunks), 0
            view = buffer[offset : offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            views.append(view)
            offset += tensor.numel()
        out.append((weights, (views[0], views[1])))
    assert offset == buffer.numel() and next(chunks, None) is None, (offset, buffer.numel())
    return out


class SlotPlacer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def place(self, slot: int, staged: Staged) -> None:
        stream = self.stream
        if stream is None:
            for weights, tensors in staged:
                weights.place(slot, tensors)
            return
        step_stream = torch.cuda.current_stream(stream.device)
        stream.wait_stream(step_stream)
        with torch.cuda.stream(stream):
            for weights, tensors in staged:
                weights.place(slot, tensors)
            ready = torch.cuda.Event()
            ready.record(stream)
        step_stream.wait_event(ready)
