"""CUDA graphs for decode steps, one per batch-size bucket (TGI's `--cuda-graphs` list).

A decode step of an 8B model launches ~300 small kernels; replaying them as one graph removes the
host launch gaps that otherwise dominate batch-1 latency. Each bucket owns a graph captured over
static input buffers. A step of B requests replays the smallest bucket >= B: the first B entries
are the real requests, the rest are padding that writes its K/V into a reserved slot of a reserved
req_to_token row, so it can never touch a live request.

Integration (ModelRunner): allocate one spare KV slot (index num_kv_slots) and one spare
req_to_token row (index max_rows) that the router never hands out, then

    self.cuda_graphs = maybe_capture_decode_graphs(
        self._forward_eager, self.backend, cfg.cuda_graph_batch_sizes, max_batch_size=self.max_rows,
        pad_row=self.max_rows, pad_slot=self.num_kv_slots, max_seq_len=self.max_seq_len, device=self.device)
    ...
    if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
        return self.cuda_graphs.replay(batch)

The logits returned by `replay` live in the graph's memory and are overwritten by the next replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tgi_compat.modeling.attention.base import AttentionBackend
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# TGI captures 1..32 by default; past 32 its decode steps run eager, which on an H200 costs ~3x per
# step (Llama-3-8B, B=64: 17 ms eager vs 6.2 ms replayed). A capture takes ~0.15 s, so we cover the
# whole default running batch.
DEFAULT_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]

StepFn = Callable[[ForwardBatch], torch.Tensor]  # ForwardBatch -> logits [R, vocab]


def resolve_batch_sizes(cuda_graphs: list[int] | None, enforce_eager: bool, max_batch_size: int) -> list[int]:
    """TGI semantics: None -> the default list (wider than TGI's); [] or [0] -> disabled; `--enforce-eager` disables too."""
    if enforce_eager:
        return []
    sizes = DEFAULT_BATCH_SIZES if cuda_graphs is None else cuda_graphs
    if any(size < 0 for size in sizes):
        raise ValueError(f"--cuda-graphs batch sizes must be positive, got {sizes}")
    return sorted({size for size in sizes if 0 < size <= max_batch_size})


@dataclass
class _StaticInputs:
    """Decode inputs of the largest bucket; a bucket of size b uses the first b entries."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    out_slots: torch.Tensor  # [N] int64
    req_rows: torch.Tensor  # [N] int64
    q_start: torch.Tensor  # [N] int64, arange (one token per request)
    q_lens: torch.Tensor  # [N] int64, ones
    kv_lens: torch.Tensor  # [N] int64
    logits_indices: torch.Tensor  # [N] int64
    rope_positions: torch.Tensor  # [3, N] int64: an M-RoPE model's t/h/w rows (all three equal while decoding)

    @classmethod
    def allocate(cls, size: int, device: torch.device) -> _StaticInputs:
        def zeros() -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int64, device=device)

        arange = torch.arange(size, dtype=torch.int64, device=device)
        rope = torch.zeros(3, size, dtype=torch.int64, device=device)
        return cls(zeros(), zeros(), zeros(), zeros(), arange, torch.ones_like(arange), zeros(), arange.clone(), rope)

    def batch(self, size: int, max_seq_len: int, mrope: bool = False) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_slots=self.out_slots[:size],
            req_rows=self.req_rows[:size],
            q_start=self.q_start[:size],
            q_lens=self.q_lens[:size],
            kv_lens=self.kv_lens[:size],
            logits_indices=self.logits_indices[:size],
            max_q_len=1,
            max_kv_len=max_seq_len,  # graph-safe backends must not size anything from this
            rope_positions=self.rope_positions[:, :size] if mrope else None,
        )


class DecodeCudaGraphs:
    def __init__(
        self,
        step_fn: StepFn,
        batch_sizes: list[int],
        pad_row: int,
        pad_slot: int,
        max_seq_len: int,
        device: torch.device,
        mrope: bool = False,
    ):
        assert batch_sizes, "no batch sizes to capture"
        self.step_fn = step_fn
        # an M-RoPE model (Qwen2.5-VL): the graphs rotate by a static [3, N] buffer, which a replay fills from the
        # step's rope_positions (a request with an image: position + its rope delta) or its plain positions
        self.mrope = mrope
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.pad_row = pad_row
        self.pad_slot = pad_slot
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        with torch.inference_mode():
            self.inputs = _StaticInputs.allocate(self.max_batch_size, self.device)
            self._pad_from(0)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bucket, vocab] logits written by each replay

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode == ForwardMode.DECODE
            and batch.lora is None  # LoRA steps run eager
            and (batch.rope_positions is None or self.mrope)  # rope rows only where captured with them
            and 0 < batch.batch_size <= self.max_batch_size
            and batch.logits_indices.shape[0] <= batch.batch_size
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one shared memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            batch = self.inputs.batch(size, self.max_seq_len, self.mrope)
            for _ in range(2):  # compile kernels and create library handles outside the capture
                self.step_fn(batch)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.step_fn(batch)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.batch_sizes,
            time.perf_counter() - start,
        )

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, vocab] of a decode batch, through the smallest captured bucket that holds it."""
        size = batch.batch_size
        bucket = next(b for b in self.batch_sizes if b >= size)
        inputs = self.inputs
        num_logits = batch.logits_indices.shape[0]
        # one multi-tensor copy kernel, not six copy-engine transfers (each a hand-over on the step's critical path)
        torch._foreach_copy_(
            [
                inputs.input_ids[:size],
                inputs.positions[:size],
                inputs.out_slots[:size],
                inputs.req_rows[:size],
                inputs.kv_lens[:size],
                inputs.logits_indices[:num_logits],
            ],
            [batch.input_ids, batch.positions, batch.out_slots, batch.req_rows, batch.kv_lens, batch.logits_indices],
            non_blocking=True,
        )
        if self.mrope:
            rope = batch.positions.expand(3, -1) if batch.rope_positions is None else batch.rope_positions
            inputs.rope_positions[:, :size].copy_(rope, non_blocking=True)
        if num_logits < bucket:  # stale indices of an earlier, larger batch could point past this bucket
            inputs.logits_indices[num_logits:bucket] = 0
        if size < bucket:
            self._pad_from(size, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:num_logits]

    def _pad_from(self, start: int, end: int | None = None) -> None:
        # Padding entries: a 1-token context at position 0 of the reserved row, K/V into the reserved slot.
        inputs = self.inputs
        inputs.input_ids[start:end] = 0
        inputs.positions[start:end] = 0
        inputs.out_slots[start:end] = self.pad_slot
        inputs.req_rows[start:end] = self.pad_row
        inputs.kv_lens[start:end] = 1
        inputs.rope_positions[:, start:end] = 0


def maybe_capture_decode_graphs(
    step_fn: StepFn,
    backend: AttentionBackend,
    batch_sizes: list[int] | None,  # the --cuda-graphs value: None = DEFAULT_BATCH_SIZES, [] = off
    max_batch_size: int,
    pad_row: int,
    pad_slot: int,
    max_seq_len: int,
    device: torch.device,
    mrope: bool = False,  # the model rotates by ForwardBatch.rope_positions (M-RoPE) when a step has them
) -> DecodeCudaGraphs | None:
    """Captured graphs on CUDA with a graph-safe attention backend and a non-empty list, else None (eager)."""
    sizes = resolve_batch_sizes(batch_sizes, enforce_eager=False, max_batch_size=max_batch_size)
    if torch.device(device).type != "cuda" or not sizes or not backend.supports_cuda_graphs:
        return None
    graphs = DecodeCudaGraphs(
        step_fn, sizes, pad_row=pad_row, pad_slot=pad_slot, max_seq_len=max_seq_len, device=device, mrope=mrope
    )
    graphs.capture()
    return graphs
