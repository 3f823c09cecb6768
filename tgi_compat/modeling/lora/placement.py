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


class SlotPlacer:
    def __init__(self, device: torch.device) -> None:
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
