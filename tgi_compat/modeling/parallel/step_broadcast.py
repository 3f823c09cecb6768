"""Rank 0 -> the other ranks: each step's ForwardBatch, in one host and one device broadcast.

Rank 0 runs the scheduler; the other ranks only run the same forward over their shard of the
weights. Per step, rank 0 sends a small header through host memory (gloo): the step's shapes, which
the other ranks need on the host to pick a kernel or a CUDA graph. Because it never touches a GPU, a
rank receives it while its GPU still runs the previous step and queues the next forward behind it,
as rank 0 does with overlap scheduling. The batch's index tensors follow in one device broadcast
(packed into one int64 buffer on the device, so the tokens sampled on the GPU by the previous step
travel without a host sync), ordered on the stream after the previous forward; the others unpack
views of it. Only the elements the step uses travel (a 64-row decode: 4 KB of the buffer's 128 KB). Its
capacity travels in the header: a step that needs more grows it on both sides.

    header = [opcode, mode, T, B, R, max_q_len, max_kv_len, has_host_lens, C, capacity, greedy_only, N, W,
              has_rope, I, S, dtype, X]
             (then, for prefill steps that carry them, the host q_lens[B] and kv_lens[B];
             for a LoRA step with N adapter loads, the host loads[2 * N]: slot, adapter id;
             for a step with I image rows, the host spans[B + 2 * S]: per request its count, then (start, end)s)
    device = input_ids[T] positions[T] out_slots[T] req_rows[B] q_start[B] q_lens[B] kv_lens[B]
             logits_indices[R] cached_prefix_slots[3 * C] (rows, positions, slots of prefix-cache hits)
             lora_slots[B] (a LoRA step: each request's adapter slot, -1 for the base model)
             prefix_table[B * W] (a --diverse_mode decode step: PrefixGroups.table, W = 1 + group_max; W = 0: none)
             rope_positions[3 * T] (an M-RoPE step's t/h/w rows) image_token_index[I]
    then, for a step with image rows, their features [I, hidden] in `dtype` (a second device broadcast)
    then, for a cross-attending model's step with image rows, its CrossAttention (parallel/cross_broadcast.py),
    whose host part is X ints long (-1: none)

N is -1 for a step without LoRA rows, I -1 for a step without images. Every rank then runs the same rows on the same adapter slots, and
copies the same adapters into them (each keeps its own cut of every adapter).

Between steps rank 0 also sends the LoRA adapters it loads (header [ADAPTER, id, n], then n bytes of JSON: name,
source, revision), at startup and while serving alike, and those it drops ([DROP_ADAPTER, id]): each rank reads
its own cut (tgi_compat.modeling.lora.manager.LoraManager.follow).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, ImageEmbeds, LoraBatch, PrefixGroups
from tgi_compat.modeling.parallel.cross_broadcast import WIRE_DTYPES, CrossKeysFollower, cross_host, send_cross_tensors
from tgi_compat.modeling.parallel.group import TensorParallel

_HEADER = 18
_INITIAL_CAPACITY = 1 << 14
_MODES = list(ForwardMode)


class _Op(enum.IntEnum):
    STEP = 1
    STOP = 2
    ADAPTER = 3
    DROP_ADAPTER = 4


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    """Rank 0 loaded a LoRA adapter under this id: every rank reads and keeps its cut."""

    adapter_id: int
    name: str
    source: str
    revision: str | None = None


@dataclass(frozen=True, slots=True)
class AdapterDrop:
    adapter_id: int


class StepBroadcast:
    def __init__(
        self,
        tp: TensorParallel,
        capacity: int = _INITIAL_CAPACITY,
        on_step: Callable[[], None] | None = None,
        hidden_size: int = 0,
    ) -> None:
        self.tp = tp
        self.hidden_size = hidden_size  # the model's: the width of an image step's feature rows
        self.on_step = on_step  # called once per step sent or received (the hang watch counts them)
        self.cross_keys: CrossKeysFollower | None = None  # ranks > 0 of a cross-attending model: their image keys
        self.header = torch.zeros(_HEADER, dtype=torch.int64)
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=self.tp.device)

    # ---- rank 0 -----------------------------------------------------------------------------
    @torch.inference_mode()
    def send(self, batch: ForwardBatch) -> None:
        num_tokens, batch_size, num_logits = batch.num_tokens, batch.batch_size, batch.logits_indices.shape[0]
        cached = batch.cached_prefix_slots
        num_cached = 0 if cached is None else cached.shape[1]
        lora, groups, rope, images = batch.lora, batch.prefix_groups, batch.rope_positions, batch.images
        width = 0 if groups is None else groups.table.shape[1]
        needed = 3 * num_tokens + 4 * batch_size + num_logits + 3 * num_cached + (0 if lora is None else batch_size)
        needed += batch_size * width
        needed += (0 if rope is None else 3 * num_tokens) + (0 if images is None else images.token_index.shape[0])
        if needed > self.capacity:
            self._allocate(max(needed, 2 * self.capacity))
        has_host_lens = batch.q_lens_cpu is not None and batch.kv_lens_cpu is not None
        header = [_Op.STEP, _MODES.index(batch.mode), num_tokens, batch_size, num_logits]
        header += [batch.max_q_len, batch.max_kv_len, int(has_host_lens), num_cached, self.capacity]
        header += [int(batch.greedy_only)]  # which collective ends the step: the logits' gather or the greedy choice
        header += [-1 if lora is None else len(lora.loads), width]
        header += [int(rope is not None), -1 if images is None else images.token_index.shape[0]]
        spans = [] if images is None else _flat_spans(images.spans, batch_size)
        header += [(len(spans) - batch_size) // 2, 0 if images is None else WIRE_DTYPES.index(images.embeds.dtype)]
        cross = [] if batch.cross is None else cross_host(batch.cross)
        header.append(len(cross) if batch.cross is not None else -1)
        self.header.copy_(torch.tensor(header, dtype=torch.int64))
        if self.on_step is not None:
            self.on_step()
        self.tp.broadcast_host(self.header)
        if has_host_lens:
            self.tp.broadcast_host(torch.tensor([*batch.q_lens_cpu, *batch.kv_lens_cpu], dtype=torch.int64))  # type: ignore[misc]
        if lora is not None and lora.loads:
            self.tp.broadcast_host(torch.tensor(lora.loads, dtype=torch.int64))
        if spans:
            self.tp.broadcast_host(torch.tensor(spans, dtype=torch.int64))
        fields = [batch.input_ids, batch.positions, batch.out_slots, batch.req_rows, batch.q_start]
        fields += [batch.q_lens, batch.kv_lens, batch.logits_indices]
        if cached is not None:
            fields.append(cached.reshape(-1))
        if lora is not None:
            fields.append(lora.slots)
        if groups is not None:
            fields.append(groups.table.reshape(-1))
        if rope is not None:
            fields.append(rope.reshape(-1))
        if images is not None:
            fields.append(images.token_index)
        torch.cat([field.to(torch.int64) for field in fields], out=self.buffer[:needed])
        self.tp.broadcast(self.buffer[:needed])  # the receivers size theirs from the header
        if images is not None:
            self.tp.broadcast(images.embeds.contiguous())
        if batch.cross is not None:
            self.tp.broadcast_host(torch.tensor(cross, dtype=torch.int64))
            send_cross_tensors(self.tp, batch.cross)

    def send_adapter(self, load: AdapterLoad) -> None:
        encoded = json.dumps([load.name, load.source, load.revision]).encode()
        self._send_op(_Op.ADAPTER, load.adapter_id, len(encoded))
        self.tp.broadcast_host(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))

    def send_adapter_drop(self, drop: AdapterDrop) -> None:
        self._send_op(_Op.DROP_ADAPTER, drop.adapter_id)

    def _send_op(self, op: _Op, *args: int) -> None:
        self.header.zero_()
        self.header[: 1 + len(args)] = torch.tensor([int(op), *args], dtype=torch.int64)
        self.tp.broadcast_host(self.header)

    @torch.inference_mode()
    def send_stop(self) -> None:
        self.header.zero_()
        self.header[0] = int(_Op.STOP)
        self.tp.broadcast_host(self.header)

    # ---- ranks > 0 --------------------------------------------------------------------------
    @torch.inference_mode()
    def receive(self) -> ForwardBatch | AdapterLoad | AdapterDrop | None:
        """The next batch (or adapter message) rank 0 sent, or None when it sent stop. A batch's tensors are views
        of the buffer: valid until the next receive (which, on a GPU, the stream orders after this step's
        forward)."""
        self.tp.broadcast_host(self.header)
        header = self.header.tolist()
        if header[0] == _Op.ADAPTER:
            encoded = torch.empty(header[2], dtype=torch.uint8)
            self.tp.broadcast_host(encoded)
            name, source, revision = json.loads(bytes(encoded.tolist()).decode())
            return AdapterLoad(header[1], name, source, revision)
        if header[0] == _Op.DROP_ADAPTER:
            return AdapterDrop(header[1])
        op, mode, num_tokens, batch_size, num_logits, max_q_len, max_kv_len, has_host_lens, num_cached = header[:9]
        capacity, greedy_only, num_loads, width, has_rope, num_image_rows, num_spans, dtype, cross_length = header[9:]
        if op == _Op.STOP:
            return None
        if self.on_step is not None:
            self.on_step()
        host_lens = None
        if has_host_lens:
            host_lens = torch.empty(2 * batch_size, dtype=torch.int64)
            self.tp.broadcast_host(host_lens)
        loads: list[tuple[int, int]] = []  # (slot, adapter id)
        if num_loads > 0:
            pairs = torch.empty(num_loads, 2, dtype=torch.int64)
            self.tp.broadcast_host(pairs)
            loads = [(slot, adapter) for slot, adapter in pairs.tolist()]
        spans: list[list[tuple[int, int]]] = []
        if num_image_rows >= 0:
            flat = torch.empty(batch_size + 2 * num_spans, dtype=torch.int64)
            if len(flat):
                self.tp.broadcast_host(flat)
            spans = _nested_spans(flat.tolist(), batch_size)
        if capacity != self.capacity:
            self._allocate(capacity)
        sizes = [num_tokens] * 3 + [batch_size] * 4 + [num_logits, 3 * num_cached]
        sizes.append(0 if num_loads < 0 else batch_size)
        sizes.append(batch_size * width)
        sizes += [3 * num_tokens if has_rope else 0, max(num_image_rows, 0)]
        used = self.buffer[: sum(sizes)]  # as many elements as rank 0 sent
        self.tp.broadcast(used)
        fields = torch.split(used, sizes)
        images = None
        if num_image_rows >= 0:
            hidden = self.hidden_size
            embeds = torch.empty(num_image_rows, hidden, dtype=WIRE_DTYPES[dtype], device=self.tp.device)
            self.tp.broadcast(embeds)
            images = ImageEmbeds(fields[12], embeds, spans)
        cross = None
        if cross_length >= 0:
            assert self.cross_keys is not None  # set for a cross-attending model (ModelRunner.follow_rank_zero)
            cross = self.cross_keys.receive(self.tp, cross_length)
        return ForwardBatch(
            mode=_MODES[mode],
            input_ids=fields[0],
            positions=fields[1],
            out_slots=fields[2],
            req_rows=fields[3],
            q_start=fields[4],
            q_lens=fields[5],
            kv_lens=fields[6],
            logits_indices=fields[7],
            max_q_len=max_q_len,
            max_kv_len=max_kv_len,
            q_lens_cpu=host_lens[:batch_size].tolist() if host_lens is not None else None,
            kv_lens_cpu=host_lens[batch_size:].tolist() if host_lens is not None else None,
            cached_prefix_slots=fields[8].view(3, num_cached) if num_cached else None,
            greedy_only=bool(greedy_only),
            lora=None if num_loads < 0 else LoraBatch(fields[9], loads),
            prefix_groups=PrefixGroups(fields[10].view(batch_size, width)) if width else None,
            images=images,
            rope_positions=fields[11].view(3, num_tokens) if has_rope else None,
            cross=cross,
        )


def _flat_spans(spans: list[list[tuple[int, int]]], batch_size: int) -> list[int]:
    """Per request: its number of bidirectional spans, then their (start, end)s; every request counted."""
    flat: list[int] = []
    for index in range(batch_size):
        own = spans[index] if index < len(spans) else []
        flat.append(len(own))
        flat += [bound for span in own for bound in span]
    return flat


def _nested_spans(flat: list[int], batch_size: int) -> list[list[tuple[int, int]]]:
    spans, at = [], 0
    for _ in range(batch_size):
        count = flat[at]
        spans.append([(flat[at + 1 + 2 * k], flat[at + 2 + 2 * k]) for k in range(count)])
        at += 1 + 2 * count
    return spans
