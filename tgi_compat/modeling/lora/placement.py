"""Adapters copied into their device slots off the step's stream.

A staged adapter (host tensors, one per slot buffer: tgi_compat.modeling.lora.weights.LoraWeights.stage), packed
into an entry of the page-locked HostPool, is copied on a side CUDA stream; the step stream waits on an event
recorded after the copies, so the slot is live for the first step that reads it and no step before waits for the
copy. The side stream first waits for the work already queued on the step stream: a step still in flight may read
the slot's previous adapter. On the CPU the copies simply run in order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence

import torch

from tgi_compat.modeling.lora.weights import LoraWeights

Staged = Sequence[tuple[LoraWeights, tuple[torch.Tensor, ...]]]
ALIGN = 16  # bytes: every packed tensor starts on it (its dtype's alignment, and the copy engines')


class HostPool:
    """Host memory for the staged adapters: `entries` of `nbytes` bytes each (an adapter cut into every slot
    buffer's shape takes the same room whatever its rank), page-locked once when LoRA starts, beside a GPU model.

    Page-locking while serving stalled every stream: a load's ~84 MB (Llama-3-8B, r = 16, all seven projections)
    locked in the reader's thread held up the engine's thread for ~50 ms, its step with it (session 27,
    TGI_STALL_TRACE_MS). An entry goes back when its adapter is dropped, to be reused once the copies out of it have
    run. A read beyond the entries (more loads at once than --max-cpu-loras) takes memory of its own, as before."""

    def __init__(self, nbytes: int, entries: int, device: torch.device) -> None:
        self.nbytes, self.device = nbytes, device
        self.buffer = self._host(entries, nbytes)
        self._lock = threading.Lock()
        # free entries, each with the event after the last copies out of it (None: none queued)
        self._free: list[tuple[int, torch.cuda.Event | None]] = [(entry, None) for entry in range(entries)]

    def stage(self, staged: Staged) -> tuple[Staged, int | None]:
        """`staged` copied into a free entry (its index) or, with none free, into a buffer of its own (None)."""
        with self._lock:
            taken = self._free.pop(0) if self._free else None
        if taken is None:
            return pack(staged, self._host(self.nbytes)), None
        entry, copied = taken
        if copied is not None:
            copied.synchronize()  # (the reader's thread waits, never the engine's)
        return pack(staged, self.buffer[entry]), entry

    def _host(self, *shape: int) -> torch.Tensor:
        """Host bytes, page-locked beside a GPU model: device="cpu" (the manager is built under the model's
        torch.device), in this GPU's context (a reader thread's current device is GPU 0, whatever the rank's)."""
        pin = self.device.type == "cuda"
        with torch.cuda.device(self.device) if pin else contextlib.nullcontext():
            return torch.empty(shape, dtype=torch.uint8, device="cpu", pin_memory=pin)

    def give_back(self, entry: int, copied: torch.cuda.Event | None) -> None:
        with self._lock:
            self._free.append((entry, copied))

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def packed_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes `pack` lays `tensors` out in (each from an ALIGN-byte boundary)."""
    return sum(_aligned(tensor.numel() * tensor.element_size()) for tensor in tensors)


def pack(staged: Staged, buffer: torch.Tensor) -> Staged:
    """`staged` copied into consecutive views of one flat uint8 `buffer` of packed_nbytes of them (their dtypes
    differ: an FP8 base's A, its scales, B)."""
    out, offset = [], 0
    for weights, tensors in staged:
        views = []
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            views.append(view)
            offset += _aligned(nbytes)
        out.append((weights, tuple(views)))
    assert offset == buffer.numel(), (offset, buffer.numel())
    return out


class SlotPlacer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def place(self, slot: int, staged: Staged) -> torch.cuda.Event | None:
        """Queue the copies; the event after them (None on the CPU, where they have run)."""
        stream = self.stream
        if stream is None:
            for weights, tensors in staged:
                weights.place(slot, tensors)
            return None
        step_stream = torch.cuda.current_stream(stream.device)
        stream.wait_stream(step_stream)
        with torch.cuda.stream(stream):
            for weights, tensors in staged:
                weights.place(slot, tensors)
            ready = torch.cuda.Event()
            ready.record(stream)
        step_stream.wait_event(ready)
        return ready
