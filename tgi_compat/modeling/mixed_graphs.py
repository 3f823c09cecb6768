"""CUDA graphs of mixed steps: the running requests decode one token each while a few prompts advance by at most
`chunk_tokens` tokens in all (--max-mixed-prefill-tokens). Without them such a step runs eager, and an eager step of
an 8B model at 64 rows is host-bound (the comment on DEFAULT_BATCH_SIZES in cuda_graphs.py: ~17 ms of launches
against ~6 ms replayed). Capping a mixed step's prompt tokens then saves its arithmetic but not its launches, and
the decoding streams still wait for the launches.

One graph per decode bucket d (the decode graphs' batch sizes). Its layout is fixed:
- requests [0, d) bring one token each: the step's leading one-token requests (the scheduler puts decodes first),
  then padding;
- requests [d, d + MAX_CHUNKS + 1) are the chunk side: the step's other requests, then one-token padding, then one
  padding request that takes the rest of the side's tokens;
- tokens [0, d) belong to the first group, tokens [d, d + chunk_tokens + MAX_CHUNKS) to the chunk side.
The token count, the request count and the decode prefix (ForwardBatch.decode_prefix) are fixed per bucket, so
the attention backend's host choices hold for every replay: flash-decoding for the first d requests, and the
extend kernel's grid over the chunk side, sized for its longest possible request. Every length is read on the
device. Padding writes the reserved slot of the reserved row, as the decode graphs' padding does.

Captured only for plain steps: a step with LoRA rows, images, cross-attention, M-RoPE rows or EAGLE-3's
auxiliary states runs eager, as does one whose layout does not fit (more chunks, more prompt tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs, PoolHandle, no_garbage_collection
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, leading_one_token_requests
from tgi_compat.modeling.graph_inputs import StaticInputs

logger = logging.getLogger(__name__)

MAX_CHUNKS = 4  # prompts advancing in one mixed step (beside the decodes) that a graph holds
StepFn = Callable[[ForwardBatch], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MixedLayout:
    """Where a step's rows go in bucket d: `lead` one-token requests first, `num_chunks` requests of `chunk_tokens`
    prompt tokens in all after them, the rest padding."""

    bucket: int
    lead: int
    num_chunks: int
    chunk_tokens: int
    side_tokens: int  # the chunk side's capacity: the cap + MAX_CHUNKS

    @property
    def num_tokens(self) -> int:
        return self.bucket + self.side_tokens

    @property
    def num_requests(self) -> int:
        return self.bucket + MAX_CHUNKS + 1

    @property
    def fill(self) -> int:
        """Tokens of the last padding request: the chunk side's tokens that no real or one-token pad request takes
        (at least 1 with one chunk or more: side_tokens - chunk_tokens - one-token pads >= num_chunks)."""
        return self.side_tokens - self.chunk_tokens - (MAX_CHUNKS - self.num_chunks)

    def host_rows(self, q_lens: list[int], kv_lens: list[int]) -> list[int]:
        """positions [num_tokens] + q_lens + kv_lens + q_start [num_requests each] + token and request
        destinations of the step's own rows, in one host list (one copy to the device)."""
        d, lead = self.bucket, self.lead
        positions = [kv - 1 for kv in kv_lens[:lead]] + [0] * (d - lead)
        for q, kv in zip(q_lens[lead:], kv_lens[lead:]):
            positions.extend(range(kv - q, kv))
        pads = MAX_CHUNKS - self.num_chunks
        positions += [0] * pads + list(range(self.fill))
        lens_q = q_lens[:lead] + [1] * (d - lead) + q_lens[lead:] + [1] * pads + [self.fill]
        lens_kv = kv_lens[:lead] + [1] * (d - lead) + kv_lens[lead:] + [1] * pads + [self.fill]
        starts, offset = [], 0
        for q in lens_q:
            starts.append(offset)
            offset += q
        assert offset == self.num_tokens and len(lens_q) == self.num_requests
        token_dest = list(range(lead)) + list(range(d, d + self.chunk_tokens))
        request_dest = list(range(lead)) + list(range(d, d + self.num_chunks))
        return positions + lens_q + lens_kv + starts + token_dest + request_dest


class MixedCudaGraphs:
    def __init__(
        self,
        step_fn: StepFn,
        batch_sizes: list[int],
        chunk_tokens: int,
        pad_row: int,
        pad_slot: int,
        max_seq_len: int,
        device: torch.device,
    ):
        assert batch_sizes and 0 < chunk_tokens
        self.step_fn = step_fn
        self.batch_sizes = sorted(batch_sizes)
        self.chunk_tokens = chunk_tokens
        self.side_tokens = min(chunk_tokens + MAX_CHUNKS, max_seq_len)
        self.pad_row, self.pad_slot = pad_row, pad_slot
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        # one token per request in the buffers' sizing: the request-side ones are longer than a bucket needs
        self.inputs = StaticInputs.allocate(self.batch_sizes[-1] + self.side_tokens, 1, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [num_requests, vocab] logits written by each replay

    def layout(self, batch: ForwardBatch) -> MixedLayout | None:
        """Where this step goes, or None when no graph holds it (it then runs eager)."""
        q_lens = batch.q_lens_cpu
        if (
            batch.mode != ForwardMode.MIXED
            or q_lens is None
            or batch.kv_lens_cpu is None
            or batch.lora is not None
            or batch.images is not None
            or batch.cross is not None
            or batch.prefix_groups is not None
            or batch.rope_positions is not None
        ):
            return None
        lead = leading_one_token_requests(q_lens)
        num_chunks, chunk_tokens = len(q_lens) - lead, batch.num_tokens - lead
        bucket = next((size for size in self.batch_sizes if size >= max(lead, 1)), None)
        if bucket is None or not 0 < num_chunks <= MAX_CHUNKS or chunk_tokens > self.chunk_tokens:
            return None
        layout = MixedLayout(bucket, lead, num_chunks, chunk_tokens, self.side_tokens)
        return layout if batch.logits_indices.shape[0] <= layout.num_requests else None

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.layout(batch) is not None

    def static_batch(self, bucket: int) -> ForwardBatch:
        """The batch a bucket's graph records, over the static inputs."""
        num_requests = bucket + MAX_CHUNKS + 1
        # max_q_len: the longest chunk-side request, which sizes the extend kernel's grid
        tokens = bucket + self.side_tokens
        return self.inputs.view(
            ForwardMode.MIXED, tokens, num_requests, num_requests, self.side_tokens, self.max_seq_len, bucket
        )

    def load_inputs(self, batch: ForwardBatch) -> MixedLayout:
        """Copy a mixed step into the static inputs in its bucket's layout (padding around its rows)."""
        layout = self.layout(batch)
        assert layout is not None and batch.q_lens_cpu is not None and batch.kv_lens_cpu is not None
        token_dest, request_dest = self._write_layout(layout, batch.q_lens_cpu, batch.kv_lens_cpu)
        inputs = self.inputs
        inputs.input_ids.index_copy_(0, token_dest, batch.input_ids)
        inputs.out_slots.index_copy_(0, token_dest, batch.out_slots)
        inputs.req_rows.index_copy_(0, request_dest, batch.req_rows)
        # a chunk-side token's logits row moves with it (bucket - lead places on)
        shift = layout.bucket - layout.lead
        moved = torch.where(batch.logits_indices >= layout.lead, batch.logits_indices + shift, batch.logits_indices)
        inputs.logits_indices[: moved.shape[0]] = moved
        return layout

    def load_padding(self, bucket: int) -> None:
        """Inputs of padding alone (one token at the reserved row per decode request, the chunk side's rest in
        one request): what the capture records over."""
        self._write_layout(MixedLayout(bucket, 0, 0, 0, self.side_tokens), [], [])

    def _write_layout(
        self, layout: MixedLayout, q_lens: list[int], kv_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layout's host-known rows (positions, lengths, starts) copied in, padding everywhere else; returns
        where the step's own tokens and requests go."""
        tokens, requests = layout.num_tokens, layout.num_requests
        host = torch.tensor(layout.host_rows(q_lens, kv_lens), dtype=torch.int64)
        rows = host.to(self.device, non_blocking=True)
        own_tokens, own_requests = layout.lead + layout.chunk_tokens, layout.lead + layout.num_chunks
        positions, lens_q, lens_kv, starts, token_dest, request_dest = rows.split(
            [tokens, requests, requests, requests, own_tokens, own_requests]
        )
        inputs = self.inputs
        torch._foreach_copy_(
            [inputs.positions[:tokens], inputs.q_lens[:requests], inputs.kv_lens[:requests], inputs.q_start[:requests]],
            [positions, lens_q, lens_kv, starts],
        )
        inputs.input_ids[:tokens] = 0
        inputs.out_slots[:tokens] = self.pad_slot
        inputs.req_rows[:requests] = self.pad_row
        inputs.logits_indices[:requests] = 0
        return token_dest, request_dest

    def graph_step(self, bucket: int) -> Callable[[], torch.Tensor]:
        """What a bucket's graph records; run eagerly after `load_inputs` (the CPU tests) it computes a replay's logits."""
        batch = self.static_batch(bucket)
        return lambda: self.step_fn(batch)

    @torch.inference_mode()
    def capture(self, pool: PoolHandle | None = None) -> None:
        start = time.perf_counter()
        with no_garbage_collection():
            for bucket in reversed(self.batch_sizes):
                self.load_padding(bucket)
                step = self.graph_step(bucket)
                for _ in range(2):  # compile kernels and create library handles outside the capture
                    step()
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket] = step()
                self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d mixed-step CUDA graphs (decode batch sizes %s beside <= %d prompt tokens) in %.1f s",
            len(self.graphs),
            self.batch_sizes,
            self.chunk_tokens,
            time.perf_counter() - start,
        )

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, vocab] of a mixed step, through its bucket's graph (read them before the next replay)."""
        layout = self.load_inputs(batch)
        self.graphs[layout.bucket].replay()
        return self.outputs[layout.bucket][: batch.logits_indices.shape[0]]


def maybe_capture_mixed_graphs(
    step_fn: StepFn,
    decode_graphs: DecodeCudaGraphs | None,
    chunk_tokens: int | None,  # --max-mixed-prefill-tokens; None: mixed steps are uncapped and run eager
    plain_steps: bool,  # False: the runner's steps carry more than plain inputs (LoRA, EAGLE-3's states)
) -> MixedCudaGraphs | None:
    """Graphs of mixed steps over the decode graphs' buckets, padding row and slot and memory pool; None where
    decode steps run eager, mixed steps are uncapped, or the runner's steps are not plain."""
    if decode_graphs is None or chunk_tokens is None or not plain_steps:
        return None
    graphs = MixedCudaGraphs(
        step_fn,
        decode_graphs.batch_sizes,
        chunk_tokens,
        pad_row=decode_graphs.pad_row,
        pad_slot=decode_graphs.pad_slot,
        max_seq_len=decode_graphs.max_seq_len,
        device=decode_graphs.device,
    )
    graphs.capture(decode_graphs.pool)
    return graphs
