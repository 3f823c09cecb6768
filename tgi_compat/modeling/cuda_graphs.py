"""CUDA graphs for decode steps, one per batch-size bucket (TGI's `--cuda-graphs` list), and for
speculative verify steps (every request brings q = k + 1 tokens: its last token and k drafts).

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

LoRA (`lora` given: --max-loras > 0): every bucket gets a second graph, captured with the LoRA layer ops on. Its
one more static input is each row's adapter slot [N] (base and padding rows -1); the graph itself turns it into
the sorted token order and the segment table (`LoraSteps.set_decode_slots`, all fixed-size, the kernels' grids
sized by --max-loras), and reads the adapters from slot buffers that loads overwrite in place, so no load ever
re-captures. A step without a LoRA row replays the plain graph, untouched.

Verify steps (`tokens_per_row` q > 1) are EXTEND steps whose every request brings q tokens; the scheduler
pads a step's drafts to one k when it may replay (tgi_compat/router/speculative/speculator.py). Their
attention is the extend kernel, whose grid depends only on the batch size and max_q_len (= q here) and
whose key loop reads kv_lens on the device, so one capture per (q, bucket) replays for any context.
Padding requests own positions 0..q-1 of the reserved row, all writing the reserved slot. Verify graphs are
captured without LoRA (a second set per q would double their capture time and memory for a rare mix): a
verify step with a LoRA row runs eager.

--diverse_mode: the decode graphs (plain and LoRA alike) read a static shared-prefix group table [N, 1 + G]
that a replay overwrites with the step's groups (padding rows in none); verify steps carry no groups.

M-RoPE models (Qwen2.5-VL): decode and verify graphs rotate by a static [3, N * q] buffer, which a replay fills
from the step's rope_positions (a request with an image: position + its rope delta) or its plain positions.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from tgi_compat.modeling.attention.base import AttentionBackend
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode
from tgi_compat.modeling.graph_inputs import StaticInputs

logger = logging.getLogger(__name__)

# TGI captures 1..32 by default; past 32 its decode steps run eager, which on an H200 costs ~3x per
# step (Llama-3-8B, B=64: 17 ms eager vs 6.2 ms replayed). A capture takes ~0.15 s, so we cover the
# whole default running batch (256), and up to 512 where --max-batch-size allows it: eager, 512 rows of an 8B
# model took ~25 ms of host a step, more than a diverse-mode step's 22 ms of kernels (H100, session 29).
DEFAULT_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
# Verify steps are captured up to this batch: past it the measured step-cost table turns drafts off on an
# H200 for an 8B model (a step of 64 x 5 rows is compute-bound), so larger verify steps are rare and run eager.
VERIFY_MAX_BATCH_SIZE = 64

StepFn = Callable[[ForwardBatch], torch.Tensor]  # ForwardBatch -> logits [R, vocab]
PoolHandle = torch.cuda._POOL_HANDLE  # a CUDA-graph memory pool (torch.cuda.graph_pool_handle())


class StepGraphs(Protocol):
    """A set of captured step graphs, as the runner picks and replays them."""

    def can_run(self, batch: ForwardBatch) -> bool: ...

    def replay(self, batch: ForwardBatch) -> torch.Tensor: ...


class LoraSteps(Protocol):
    """The LoRA side of a model (tgi_compat.modeling.lora.manager.LoraManager), as the graphs' capture needs it."""

    def set_decode_slots(self, slots: torch.Tensor | None) -> None:
        """The next forwards run LoRA segments built from `slots` ([b] int64, -1: base row); None: plain ones."""
        ...


def resolve_batch_sizes(cuda_graphs: list[int] | None, enforce_eager: bool, max_batch_size: int) -> list[int]:
    """TGI semantics: None -> the default list (wider than TGI's); [] or [0] -> disabled; `--enforce-eager` disables too."""
    if enforce_eager:
        return []
    sizes = DEFAULT_BATCH_SIZES if cuda_graphs is None else cuda_graphs
    if any(size < 0 for size in sizes):
        raise ValueError(f"--cuda-graphs batch sizes must be positive, got {sizes}")
    return sorted({size for size in sizes if 0 < size <= max_batch_size})


class DecodeCudaGraphs:
    def __init__(
        self,
        step_fn: StepFn,
        batch_sizes: list[int],
        pad_row: int,
        pad_slot: int,
        max_seq_len: int,
        device: torch.device,
        lora: LoraSteps | None = None,
        tokens_per_row: int = 1,  # q > 1: verify steps of q tokens per request
        prefix_group_max: int = 0,  # --diverse_mode (decode graphs only): a static shared-prefix group table
        mrope: bool = False,  # an M-RoPE model: the graphs rotate by a static [3, N * q] buffer
    ):
        assert batch_sizes, "no batch sizes to capture"
        assert 1 <= tokens_per_row <= max_seq_len
        self.step_fn = step_fn
        self.lora = lora
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.pad_row = pad_row
        self.pad_slot = pad_slot
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        with torch.inference_mode():
            self.inputs = StaticInputs.allocate(
                self.max_batch_size, tokens_per_row, self.device, prefix_group_max, mrope
            )
            self._pad_positions = torch.arange(tokens_per_row, device=self.device).repeat(self.max_batch_size)
            self._pad_from(0)
        # keyed by (bucket, LoRA step?)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}  # [bucket * q, vocab] logits written by each replay
        self.pool: PoolHandle | None = None  # the graphs' memory pool, once captured

    @property
    def tokens_per_row(self) -> int:
        return self.inputs.tokens_per_row

    @property
    def mrope(self) -> bool:
        return self.inputs.rope_positions is not None

    def can_run(self, batch: ForwardBatch) -> bool:
        q = self.inputs.tokens_per_row
        if q == 1:
            shape_ok = batch.mode == ForwardMode.DECODE
        else:  # every request brings exactly q tokens (the host lengths say so without a device sync)
            shape_ok = (
                batch.mode == ForwardMode.EXTEND
                and batch.max_q_len == q
                and batch.q_lens_cpu is not None
                and all(n == q for n in batch.q_lens_cpu)
                and batch.cached_prefix_slots is None
            )
        return (
            shape_ok
            and (batch.lora is None or self.lora is not None)  # verify graphs have no LoRA: such steps run eager
            and batch.images is None
            and (batch.prefix_groups is None or self.inputs.prefix_table is not None)  # groups: decode graphs only
            and (batch.rope_positions is None or self.mrope)  # rope rows only where captured with them
            and 0 < batch.batch_size <= self.max_batch_size
            and batch.logits_indices.shape[0] <= batch.num_tokens
        )

    @torch.inference_mode()
    def capture(self, pool: PoolHandle | None = None) -> None:
        """Capture every bucket, largest first, in one shared memory pool (`pool`: another graph set's, whose
        steps never run at the same time as these; the intermediates are then shared too)."""
        start = time.perf_counter()
        pool = self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        kinds = (False, True) if self.lora is not None else (False,)
        with no_garbage_collection():
            for size in reversed(self.batch_sizes):
                for with_lora in kinds:
                    self._capture_one(size, with_lora, pool)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d %s CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            "decode" if self.tokens_per_row == 1 else f"verify ({self.tokens_per_row} tokens per request)",
            self.batch_sizes,
            time.perf_counter() - start,
        )

    def graph_step(self, size: int, with_lora: bool) -> Callable[[], torch.Tensor]:
        """What the graph of (bucket `size`, LoRA step or not) records, over the static inputs; run eagerly (as
        the CPU tests do, after `load_inputs`) it computes what a replay would. Call `end_graph_steps` after."""
        batch = self.inputs.batch(size, self.max_seq_len)
        lora = self.lora
        if lora is None:
            return lambda: self.step_fn(batch)
        slots = self.inputs.lora_slots[:size] if with_lora else None

        def step() -> torch.Tensor:
            lora.set_decode_slots(slots)  # inside the capture: the graph builds the segments itself
            return self.step_fn(batch)

        return step

    def end_graph_steps(self) -> None:
        if self.lora is not None:
            self.lora.set_decode_slots(None)  # no eager step may read the static segments

    def _capture_one(self, size: int, with_lora: bool, pool: PoolHandle) -> None:
        step = self.graph_step(size, with_lora)
        try:
            for _ in range(2):  # compile kernels and create library handles outside the capture
                step()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size, with_lora] = step()
            self.graphs[size, with_lora] = graph
        finally:
            self.end_graph_steps()

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, vocab] of a decode (or verify) batch, through the smallest captured bucket that holds it."""
        key = self.load_inputs(batch)
        self.graphs[key].replay()
        return self.outputs[key][: batch.logits_indices.shape[0]]

    def load_inputs(self, batch: ForwardBatch) -> tuple[int, bool]:
        """Copy a decode (or verify) batch into the static inputs (padded to its bucket); returns the graph's key."""
        size = batch.batch_size
        bucket = next(b for b in self.batch_sizes if b >= size)
        inputs = self.inputs
        q = inputs.tokens_per_row
        num_tokens, num_logits = size * q, batch.logits_indices.shape[0]
        # one multi-tensor copy kernel, not six copy-engine transfers (each a hand-over on the step's critical path)
        torch._foreach_copy_(
            [
                inputs.input_ids[:num_tokens],
                inputs.positions[:num_tokens],
                inputs.out_slots[:num_tokens],
                inputs.req_rows[:size],
                inputs.kv_lens[:size],
                inputs.logits_indices[:num_logits],
            ],
            [batch.input_ids, batch.positions, batch.out_slots, batch.req_rows, batch.kv_lens, batch.logits_indices],
            non_blocking=True,
        )
        if inputs.prefix_table is not None:  # a step without groups (e.g. built by a path that makes none): no group
            if batch.prefix_groups is None:
                inputs.clear_groups(0, size)
            else:
                inputs.prefix_table[:size].copy_(batch.prefix_groups.table, non_blocking=True)
        if inputs.rope_positions is not None:  # the step's rows (an image request: position + its rope delta)
            rope = batch.positions.expand(3, -1) if batch.rope_positions is None else batch.rope_positions
            inputs.rope_positions[:, :num_tokens].copy_(rope, non_blocking=True)
        if num_logits < bucket * q:  # stale indices of an earlier, larger batch could point past this bucket
            inputs.logits_indices[num_logits : bucket * q] = 0
        with_lora = batch.lora is not None
        if with_lora:
            assert batch.lora is not None
            inputs.lora_slots[:size].copy_(batch.lora.slots, non_blocking=True)
        if size < bucket:
            self._pad_from(size, bucket)
        return bucket, with_lora

    def _pad_from(self, start: int, end: int | None = None) -> None:
        # Padding requests: q tokens at positions 0..q-1 of the reserved row, K/V into the reserved slot.
        inputs = self.inputs
        q = inputs.tokens_per_row
        token_end = None if end is None else end * q
        inputs.input_ids[start * q : token_end] = 0
        if q == 1:
            inputs.positions[start:end] = 0
        else:  # 0..q-1 per padding request (the same pattern at every offset)
            inputs.positions[start * q : token_end] = self._pad_positions[start * q : token_end]
        inputs.out_slots[start * q : token_end] = self.pad_slot
        inputs.req_rows[start:end] = self.pad_row
        inputs.kv_lens[start:end] = q
        inputs.lora_slots[start:end] = -1
        inputs.clear_groups(start, end)  # padding rows are in no group
        if inputs.rope_positions is not None:  # padding rotates by its plain positions
            inputs.rope_positions[:, start * q : token_end] = inputs.positions[start * q : token_end]


def maybe_capture_decode_graphs(
    step_fn: StepFn,
    backend: AttentionBackend,
    batch_sizes: list[int] | None,  # the --cuda-graphs value: None = DEFAULT_BATCH_SIZES, [] = off
    max_batch_size: int,
    pad_row: int,
    pad_slot: int,
    max_seq_len: int,
    device: torch.device,
    lora: LoraSteps | None = None,  # --max-loras > 0: LoRA decode steps get graphs of their own
    prefix_group_max: int = 0,  # --diverse_mode: decode steps carry shared-prefix groups of up to this many rows
    mrope: bool = False,  # the model rotates by ForwardBatch.rope_positions (M-RoPE) when a step has them
) -> DecodeCudaGraphs | None:
    """Captured graphs on CUDA with a graph-safe attention backend and a non-empty list, else None (eager)."""
    sizes = resolve_batch_sizes(batch_sizes, enforce_eager=False, max_batch_size=max_batch_size)
    if torch.device(device).type != "cuda" or not sizes or not backend.supports_cuda_graphs:
        return None
    graphs = DecodeCudaGraphs(
        step_fn,
        sizes,
        pad_row=pad_row,
        pad_slot=pad_slot,
        max_seq_len=max_seq_len,
        device=device,
        lora=lora,
        prefix_group_max=prefix_group_max,
        mrope=mrope,
    )
    graphs.capture()
    return graphs


def verify_batch_sizes(decode_sizes: list[int]) -> list[int]:
    """The decode buckets that verify steps capture too (those up to VERIFY_MAX_BATCH_SIZE)."""
    return [size for size in decode_sizes if size <= VERIFY_MAX_BATCH_SIZE]


def maybe_capture_verify_graphs(
    step_fn: StepFn,
    decode_graphs: DecodeCudaGraphs | None,
    num_speculative_tokens: int,
    max_seq_len: int,
) -> dict[int, DecodeCudaGraphs]:
    """Speculative decoding on: graphs of verify steps of q = k + 1 tokens per request for every k in
    1..num_speculative_tokens, over the decode graphs' buckets up to VERIFY_MAX_BATCH_SIZE; keyed by q.
    Empty when decode steps run eager (no CUDA, a backend that is not graph-safe, --cuda-graphs 0)."""
    if decode_graphs is None or num_speculative_tokens < 1:
        return {}
    sizes = verify_batch_sizes(decode_graphs.batch_sizes)
    graphs: dict[int, DecodeCudaGraphs] = {}
    if not sizes:
        return graphs
    for q in range(2, min(num_speculative_tokens + 1, max_seq_len) + 1):
        graphs[q] = DecodeCudaGraphs(
            step_fn,
            sizes,
            pad_row=decode_graphs.pad_row,
            pad_slot=decode_graphs.pad_slot,
            max_seq_len=max_seq_len,
            device=decode_graphs.device,
            tokens_per_row=q,
            mrope=decode_graphs.mrope,
        )
        graphs[q].capture(decode_graphs.pool)
    return graphs


@contextlib.contextmanager
def no_garbage_collection() -> Iterator[None]:
    """No collection inside a capture: a collected object's finalizer may call CUDA (a dead runner's page-locked
    buffers, events, streams), which a global-mode capture forbids. The suspected cause of captures invalidated at
    random in a GPU test that builds runner after runner (tests/gpu/test_qwen2_5_vl_gpu.py, sessions 26 and 27). Every
    graph set's capture runs inside it (mixed_graphs.py too)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
