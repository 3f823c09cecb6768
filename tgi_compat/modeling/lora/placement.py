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


def pinned(staged: Staged, device: torch.device) -> Staged:
    """A staged adapter in pinned host memory beside a GPU model, so that `place` is one asynchronous copy per
    tensor: all of its tensors in one pinned buffer. One page-locking call instead of one per tensor (256 for
    Llama-3-8B): each is a driver call that the serving thread's launches contend with while a load is read."""
    if device.type != "cuda" or not staged:
        return staged
    dtype = staged[0][1][0].dtype  # (every slot buffer is in the model's dtype)
    # this GPU's context (a reader thread's current device is GPU 0, whatever the rank's)
    with torch.cuda.device(device):
        buffer = torch.empty(sum(t.numel() for _, pair in staged for t in pair), dtype=dtype, pin_memory=True)
    return pack(staged, buffer)


def pack(staged: Staged, buffer: torch.Tensor) -> Staged:
    """`staged` copied into consecutive views of one flat `buffer` (as many elements as they hold together)."""
    out, offset = [], 0
    for weights, pair in staged:
        views = []
        for tensor in pair:
            assert tensor.dtype == buffer.dtype, (tensor.dtype, buffer.dtype)
            view = buffer[offset : offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            views.append(view)
            offset += tensor.numel()
        out.append((weights, (views[0], views[1])))
    assert offset == buffer.numel(), (offset, buffer.numel())
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
