"""StepPlan -> ForwardBatch: the flat token batch of one step, and where each chunk's logits land.

Logits rows come in chunk order: a chunk that wants prompt logprobs asks for every position that
scores a next prompt token, then a sampled chunk asks for its last position.

The usual step is all decodes (one sampled token per request, no prompt logprobs). It takes a
fast path: its per-step ids go to the device in a single copy, and the fields that only depend
on the batch size (q_start, q_lens, logits_indices) are device tensors made once per size.

With overlap scheduling a request's input token may still be on the device: `input_rows[i]` (from
the executor) is then the row of `previous_ids`, the sampled ids of the step in flight, that holds
chunk i's input, taken by a gather on the device.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from tgi_compat.modeling import copy_streams
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, LoraBatch, PrefixGroups, build_forward_batch
from tgi_compat.router.cross_attention import CrossAttentionStore
from tgi_compat.router.image_cache import ChunkImages, EncoderCache
from tgi_compat.router.prefix_groups import GroupCounts, shared_prefix_groups
from tgi_compat.router.step import StepPlan

# Per chunk of a plan: the row of the in-flight step's sampled ids holding its input, or None.
InputRows = Sequence[int | None]


@dataclass(slots=True)
class LogitsLayout:
    sample_rows: list[int]  # logits row of each sampled chunk, in chunk order
    sampled_chunks: list[int]  # index in plan.chunks of each sampled row
    prompt_rows: list[int]  # logits rows scoring prompt tokens
    prompt_next_ids: list[int]  # the prompt token each of those rows predicts
    prompt_chunks: list[tuple[int, int]]  # (chunk index, number of rows), in row order
    # Verify chunks sample every position: each sampled row's position in its chunk (its noise counter's
    # offset), None when no chunk of the step verifies drafts
    sample_offsets: list[int] | None = None


def upload(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Host int lists of one length -> [len(rows), n] int64 on `device`, in one copy.

    Pinned on a GPU so that the copy is asynchronous (on a side stream: tgi_compat.modeling.copy_streams); the
    caching host allocator keeps the pinned block alive until the copy has run. Each row starts 16-byte aligned
    (an odd n is padded by one): Triton compiles a kernel anew for a pointer off that alignment, and the first
    65-row decode (out_slots = row 1) compiled the KV store mid-serving, a 181 ms stall of every stream.
    """
    width = len(rows[0]) if rows else 0
    if width % 2:
        rows = [[*row, 0] for row in rows]
    host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
    return copy_streams.upload(host, device)[:, :width]


class StepBatchBuilder:
    def __init__(
        self,
        device: torch.device | str,
        lora_enabled: bool = False,
        images: EncoderCache | None = None,
        prefix_group_max: int = 0,
        cross: CrossAttentionStore | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.lora_enabled = lora_enabled  # off: no step looks at adapters
        self.images = images  # a vision model's: prompt images' rows into their chunks' batches
        self.cross = cross  # a cross-attending model's (Mllama): its requests' image keys, instead of `images`
        # --diverse_mode: each decode step carries its rows' shared-prefix groups of up to this many rows (0: off)
        self.prefix_group_max = prefix_group_max
        self.group_counts = GroupCounts()
        self._constants: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # B -> (arange, ones)

    def build(
        self, plan: StepPlan, previous_ids: torch.Tensor | None = None, input_rows: InputRows | None = None
    ) -> tuple[ForwardBatch, LogitsLayout]:
        """`previous_ids`: [R] sampled ids of the step in flight; `input_rows[i]`: the row of it that
        holds chunk i's input, None where the input is on the host."""
        rows = input_rows if previous_ids is not None and input_rows is not None else [None] * len(plan.chunks)
        if not plan.cached_prefixes and all(
            c.num_tokens == 1 and c.is_sampled and c.num_prompt_logprob_rows is None and c.request.mrope is None
            for c in plan.chunks
        ):
            batch, layout = self._build_decode(plan, previous_ids, rows)
        else:
            batch, layout = build_step_batch(plan, self.device, previous_ids, rows, self.images)
        if self.lora_enabled:
            batch.lora = lora_batch(plan, self.device)
        if self.cross is not None:
            offsets = itertools.accumulate((c.num_tokens for c in plan.chunks), initial=0)
            chunks = [(offset, c.start, c.end, c.request) for offset, c in zip(offsets, plan.chunks)]
            batch.cross = self.cross.step(chunks, self.device)
        if self.prefix_group_max and batch.mode == ForwardMode.DECODE:
            batch.prefix_groups = prefix_groups(plan, self.prefix_group_max, self.device, self.group_counts)
        return batch, layout

    def _build_decode(
        self, plan: StepPlan, previous_ids: torch.Tensor | None, input_rows: InputRows
    ) -> tuple[ForwardBatch, LogitsLayout]:
        """Every chunk runs the last token of its sequence (position start) and samples after it."""
        chunks = plan.chunks
        requests = [c.request for c in chunks]
        positions = [c.start for c in chunks]
        kv_lens = [p + 1 for p in positions]
        rows = cast(list[int], [r.row for r in requests])  # scheduled requests hold a row
        columns = [positions, [c.slots[0] for c in chunks], rows, kv_lens]
        if previous_ids is not None and _inputs_are_previous_rows(input_rows, previous_ids):
            packed = upload(columns, self.device)  # [4, B]
            input_ids = previous_ids  # the steady state of overlap scheduling: no gather
        else:
            columns.append([(r.output_ids or r.params.prompt_ids)[-1] for r in requests])
            sources = _input_sources(input_rows, previous_ids)
            if sources is not None:
                columns.append(sources)
            packed = upload(columns, self.device)  # [5 or 6, B]
            if sources is None:
                input_ids = packed[4]
            else:  # sources exist only when some token is pending in previous_ids
                assert previous_ids is not None
                input_ids = torch.cat([previous_ids, packed[4]])[packed[5]]
        arange, ones = self._size_constants(len(chunks))
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=packed[0],
            out_slots=packed[1],
            req_rows=packed[2],
            q_start=arange,
            q_lens=ones,
            kv_lens=packed[3],
            logits_indices=arange,
            max_q_len=1,
            max_kv_len=max(kv_lens),
            q_lens_cpu=[1] * len(chunks),
            kv_lens_cpu=kv_lens,
        )
        rows = list(range(len(chunks)))
        return batch, LogitsLayout(rows, rows, [], [], [])

    def _size_constants(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only [B] int64 tensors 0..B-1 and ones, shared by every decode step of that size."""
        if (constants := self._constants.get(size)) is None:
            arange = torch.arange(size, dtype=torch.int64, device=self.device)
            constants = self._constants[size] = (arange, torch.ones_like(arange))
        return constants


def prefix_groups(plan: StepPlan, group_max: int, device: torch.device, counts: GroupCounts) -> PrefixGroups:
    """The decode step's rows grouped by the cached prefix they share (n / best_of siblings); maybe no group."""
    prefixes = [chunk.request.cached_prefix for chunk in plan.chunks]
    groups = shared_prefix_groups([None if p is None else p.shared_node() for p in prefixes], group_max)
    counts.add(groups, len(plan.chunks))
    return PrefixGroups(upload(PrefixGroups.rows(groups, len(plan.chunks), group_max), device))


def lora_batch(plan: StepPlan, device: torch.device) -> LoraBatch | None:
    """Each request's adapter slot, or None when no request of the step has an adapter."""
    slots = [chunk.request.lora_slot for chunk in plan.chunks]
    if max(slots) < 0:
        return None
    return LoraBatch(upload([slots], device)[0], plan.lora_loads)


def _inputs_are_previous_rows(input_rows: InputRows, previous_ids: torch.Tensor) -> bool:
    """Chunk i's input is row i of the step in flight, for every i (same requests, same order)."""
    return len(input_rows) == previous_ids.shape[0] and all(row == i for i, row in enumerate(input_rows))


def _input_sources(input_rows: InputRows, previous_ids: torch.Tensor | None) -> list[int] | None:
    """Index of each input in cat(previous_ids, host ids), or None when none is pending."""
    if previous_ids is None or all(row is None for row in input_rows):
        return None
    offset = previous_ids.shape[0]
    return [offset + i if row is None else row for i, row in enumerate(input_rows)]


def build_step_batch(
    plan: StepPlan,
    device: torch.device | str,
    previous_ids: torch.Tensor | None = None,
    input_rows: InputRows | None = None,
    images: EncoderCache | None = None,
) -> tuple[ForwardBatch, LogitsLayout]:
    """Any plan (prefill chunks, prompt logprobs, decodes mixed in)."""
    chunk_images: list[ChunkImages] = []
    input_ids: list[int] = []
    out_slots: list[int] = []
    logits_indices: list[int] = []
    pending: list[tuple[int, int]] = []  # (flat position, row of previous_ids) of tokens still on the device
    req_rows: list[int] = []
    layout = LogitsLayout([], [], [], [], [])
    for index, chunk in enumerate(plan.chunks):
        request, offset = chunk.request, len(input_ids)
        assert request.row is not None  # a scheduled request holds a row
        req_rows.append(request.row)
        if input_rows is not None and (pending_row := input_rows[index]) is not None:  # the token in flight
            assert chunk.num_tokens == 1 and previous_ids is not None
            pending.append((offset, pending_row))
            input_ids.append(0)
        elif chunk.drafts:
            input_ids += request.token_ids(chunk.start, chunk.end - len(chunk.drafts)) + chunk.drafts
        else:
            input_ids += request.token_ids(chunk.start, chunk.end)
        out_slots += chunk.slots
        chunk_images.append((offset, chunk.start, chunk.end, request.params.images))
        if chunk.num_prompt_logprob_rows is not None:
            num_rows = chunk.num_prompt_logprob_rows
            layout.prompt_rows += range(len(logits_indices), len(logits_indices) + num_rows)
            logits_indices += range(offset, offset + num_rows)
            layout.prompt_next_ids += request.params.prompt_ids[chunk.start + 1 : chunk.start + 1 + num_rows]
            layout.prompt_chunks.append((index, num_rows))
        if chunk.drafts:
            _add_verify_rows(layout, index, chunk.num_tokens, len(logits_indices))
            logits_indices += range(offset, offset + chunk.num_tokens)
        elif chunk.is_sampled:
            layout.sample_rows.append(len(logits_indices))
            layout.sampled_chunks.append(index)
            logits_indices.append(offset + chunk.num_tokens - 1)
            if layout.sample_offsets is not None:
                layout.sample_offsets.append(0)
    batch = build_forward_batch(
        input_ids=input_ids,
        req_rows=req_rows,
        q_lens=[chunk.num_tokens for chunk in plan.chunks],
        kv_lens=[chunk.end for chunk in plan.chunks],
        out_slots=out_slots,
        logits_indices=logits_indices,
        device=device,
    )
    if pending:
        assert previous_ids is not None  # pending tokens are read from the step in flight
        positions, rows = upload([list(p) for p in zip(*pending)], torch.device(device))
        batch.input_ids[positions] = previous_ids[rows]
    if images is not None:
        batch.images = images.step_embeds(chunk_images, torch.device(device))
    if any(chunk.request.mrope is not None for chunk in plan.chunks):
        batch.rope_positions = upload(_rope_rows(plan), torch.device(device))
    if plan.cached_prefixes:
        batch.cached_prefix_slots = _cached_prefix_slots(plan.cached_prefixes, torch.device(device))
    return batch, layout


def _rope_rows(plan: StepPlan) -> list[list[int]]:
    """(t, h, w) rotary positions of the step's tokens: an M-RoPE request's (router/mrope.py), the others' own."""
    rows: list[list[int]] = [[], [], []]
    for chunk in plan.chunks:
        mrope = chunk.request.mrope
        axes = mrope.rows(chunk.start, chunk.end) if mrope is not None else [range(chunk.start, chunk.end)] * 3
        for row, axis in zip(rows, axes):
            row += axis
    return rows


def _add_verify_rows(layout: LogitsLayout, chunk_index: int, num_tokens: int, first_row: int) -> None:
    """A verify chunk samples each of its positions, the j-th with its noise counter j tokens ahead."""
    if layout.sample_offsets is None:
        layout.sample_offsets = [0] * len(layout.sample_rows)
    layout.sample_rows += range(first_row, first_row + num_tokens)
    layout.sampled_chunks += [chunk_index] * num_tokens
    layout.sample_offsets += range(num_tokens)


def _cached_prefix_slots(prefixes: list[tuple[int, list[int]]], device: torch.device) -> torch.Tensor:
    """[3, H]: (row, position, slot) of every position of the prefix-cache hits.

    Only distinct slot lists cross from the host, as one flat buffer: 16 requests hitting one
    4,000-token system prompt send its 4,000 slots once, not 64k. Per hit go its row, length and
    where its slots start in that buffer; rows, positions and slots are expanded on the device.
    """
    buffer: list[list[int]] = []  # the distinct slot lists, concatenated in this order
    sources: list[int] = []  # per hit: where its slots start in the buffer
    starts_by_key: dict[tuple[int, int, int], int] = {}  # (length, first, last slot) -> a buffer start
    lists_by_start: dict[int, list[int]] = {}
    num_buffered = 0
    for _, prefix in prefixes:
        key = (len(prefix), prefix[0], prefix[-1]) if prefix else (0, 0, 0)
        source = starts_by_key.get(key)
        if source is None or lists_by_start[source] != prefix:  # (one C compare)
            source = starts_by_key[key] = num_buffered
            lists_by_start[source] = prefix
            buffer.append(prefix)
            num_buffered += len(prefix)
        sources.append(source)
    lengths = [len(prefix) for _, prefix in prefixes]
    total = sum(lengths)
    starts = list(itertools.accumulate(lengths, initial=0))[:-1]
    small = upload([[row for row, _ in prefixes], lengths, starts, sources], device)
    rows, counts, offsets, source_starts = small[0], small[1], small[2], small[3]
    slots = array.array("q", itertools.chain.from_iterable(buffer))
    host = torch.frombuffer(slots, dtype=torch.int64) if num_buffered else torch.empty(0, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    distinct = copy_streams.upload(host, device)
    out = torch.empty(3, total, dtype=torch.int64, device=device)
    out[0] = rows.repeat_interleave(counts, output_size=total)
    out[1] = torch.arange(total, device=device) - offsets.repeat_interleave(counts, output_size=total)
    out[2] = distinct[source_starts.repeat_interleave(counts, output_size=total) + out[1]]
    return out
