"""Rank 0 -> the other ranks: each step's ForwardBatch, in one broadcast.

Rank 0 runs the scheduler; the other ranks only run the same forward over their shard of the
weights. Per step, rank 0 packs the batch's index tensors into one int64 buffer (on the device, so
the tokens sampled on the GPU by the previous step travel without a host sync) and broadcasts it;
the others unpack views of the same buffer. The buffer has a fixed size, so no step sends its
length first: a step that would not fit sends a RESIZE header, after which both sides grow it.

    buffer = [opcode, mode, T, B, R, max_q_len, max_kv_len, has_host_lens, C, capacity | payload ...]
    payload = input_ids[T] positions[T] out_slots[T] req_rows[B] q_start[B] q_lens[B] kv_lens[B]
              logits_indices[R] cached_prefix_slots[3 * C] (rows, positions, slots of prefix-cache hits)
"""

from __future__ import annotations

import enum

import torch

from modeling.forward_batch import ForwardBatch, ForwardMode
from modeling.parallel.group import TensorParallel

_HEADER = 10
_INITIAL_CAPACITY = 1 << 14
_MODES = list(ForwardMode)


class _Op(enum.IntEnum):
    STEP = 1
    STOP = 2
    RESIZE = 3


class StepBroadcast:
    def __init__(self, tp: TensorParallel, capacity: int = _INITIAL_CAPACITY) -> None:
        self.tp = tp
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = torch.zeros(_HEADER + capacity, dtype=torch.int64, device=self.tp.device)

    # ---- rank 0 -----------------------------------------------------------------------------
    @torch.inference_mode()
    def send(self, batch: ForwardBatch) -> None:
        num_tokens, batch_size, num_logits = batch.num_tokens, batch.batch_size, batch.logits_indices.shape[0]
        cached = batch.cached_prefix_slots
        num_cached = 0 if cached is None else cached.shape[1]
        needed = 3 * num_tokens + 4 * batch_size + num_logits + 3 * num_cached
        if needed > self.capacity:
            capacity = max(needed, 2 * self.capacity)
            self._send_header(_Op.RESIZE, capacity=capacity)
            self._allocate(capacity)
        has_host_lens = batch.q_lens_cpu is not None and batch.kv_lens_cpu is not None
        mode = _MODES.index(batch.mode)
        header = [
            _Op.STEP,
            mode,
            num_tokens,
            batch_size,
            num_logits,
            batch.max_q_len,
            batch.max_kv_len,
            int(has_host_lens),
            num_cached,
        ]
        self.buffer[:_HEADER].copy_(torch.tensor([*header, self.capacity], dtype=torch.int64), non_blocking=True)
        fields = [batch.input_ids, batch.positions, batch.out_slots, batch.req_rows, batch.q_start]
        fields += [batch.q_lens, batch.kv_lens, batch.logits_indices]
        if cached is not None:
            fields.append(cached.reshape(-1))
        torch.cat([field.to(torch.int64) for field in fields], out=self.buffer[_HEADER : _HEADER + needed])
        self.tp.broadcast(self.buffer)

    @torch.inference_mode()
    def send_stop(self) -> None:
        self._send_header(_Op.STOP)

    def _send_header(self, op: _Op, capacity: int = 0) -> None:
        self.buffer[:_HEADER] = 0
        self.buffer[0], self.buffer[_HEADER - 1] = int(op), capacity or self.capacity
        self.tp.broadcast(self.buffer)

    # ---- ranks > 0 --------------------------------------------------------------------------
    @torch.inference_mode()
    def receive(self) -> ForwardBatch | None:
        """The next batch rank 0 sent, or None when it sent stop. Views of the buffer: valid until
        the next receive (which, on a GPU, the stream orders after this step's forward)."""
        while True:
            self.tp.broadcast(self.buffer)
            header = self.buffer[:_HEADER].tolist()
            op, mode, num_tokens, batch_size, num_logits, max_q_len, max_kv_len, has_host_lens, num_cached, capacity = (
                header
            )
            if op == _Op.STOP:
                return None
            if op == _Op.RESIZE:
                self._allocate(capacity)
                continue
            sizes = [num_tokens] * 3 + [batch_size] * 4 + [num_logits, 3 * num_cached]
            fields = torch.split(self.buffer[_HEADER : _HEADER + sum(sizes)], sizes)
            q_lens, kv_lens = fields[5], fields[6]
            return ForwardBatch(
                mode=_MODES[mode],
                input_ids=fields[0],
                positions=fields[1],
                out_slots=fields[2],
                req_rows=fields[3],
                q_start=fields[4],
                q_lens=q_lens,
                kv_lens=kv_lens,
                logits_indices=fields[7],
                max_q_len=max_q_len,
                max_kv_len=max_kv_len,
                q_lens_cpu=q_lens.tolist() if has_host_lens else None,
                kv_lens_cpu=kv_lens.tolist() if has_host_lens else None,
                cached_prefix_slots=fields[8].view(3, num_cached) if num_cached else None,
            )
