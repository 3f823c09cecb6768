"""Carry a step's SamplingBatch forward to the next step while the same requests are sampled.

In a run of decode steps the sampled requests, their order and their parameters stay the same;
only each request's noise counter and token history grow by the token just drawn. Rebuilding the
batch from Python lists costs a few host->device copies per step and, with penalties, a copy of
every request's whole context; carrying it forward costs a few device ops and no copy at all:

    batch = cache.get(requests, healer)     # built, or the previous batch advanced on the device
    out = sampler(logits, batch)
    cache.sampled(out.token_ids)            # the ids the next get() appends to the history

The carried batch is used only when each request is the same object in the same row and holds
exactly one more generated token (counting one still on the device) than when the batch was made
(the token recorded by sampled()).
Anything else (a request joined, finished, was preempted or failed, a step was retried) rebuilds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tgi_compat.router.request import Request
from tgi_compat.router.sampling.batch import SamplingBatch, last_token

if TYPE_CHECKING:
    from tgi_compat.router.sampling.token_healing import TokenHealer

CONTEXT_HEADROOM = 64  # spare history columns: the penalty table grows once per this many steps


class SamplingBatchCache:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._requests: list[Request] = []
        self._next_lengths: list[int] = []  # len(output_ids) of each request when the batch is reusable
        self._batch: SamplingBatch | None = None
        self._sampled_ids: torch.Tensor | None = None  # [B] int64, drawn with _batch
        self._positions = torch.empty(0, 1, dtype=torch.int64)  # [B, 1]: where each row's next id goes
        self._max_length = 0  # longest history in _batch.context_ids (host copy, for growing it)
        self.num_builds = 0  # batches built from scratch (tests check when the cache is used)

    def get(self, requests: Sequence[Request], healer: TokenHealer | None = None) -> SamplingBatch:
        requests = list(requests)
        lengths = [r.num_output_tokens for r in requests]
        previous, sampled = self._batch, self._sampled_ids
        if (
            previous is not None
            and sampled is not None
            and lengths == self._next_lengths
            and requests == self._requests
        ):
            batch = self._advance(previous, sampled, requests, healer)
        else:
            batch = self._build(requests, healer)
        self._requests, self._batch, self._sampled_ids = requests, batch, None
        self._next_lengths = [n + 1 for n in lengths]
        return batch

    def sampled(self, token_ids: torch.Tensor) -> None:
        """[B] ids chosen with the batch get() just returned, still on the device."""
        self._sampled_ids = token_ids

    def _build(self, requests: list[Request], healer: TokenHealer | None) -> SamplingBatch:
        self.num_builds += 1
        batch = SamplingBatch.build(requests, self.vocab_size, self.device, healer, CONTEXT_HEADROOM)
        if batch.context_lens is not None:
            self._positions = batch.context_lens.to(torch.int64)  # [B, 1]
            self._max_length = max(r.num_tokens for r in requests)
        return batch

    def _advance(
        self, previous: SamplingBatch, sampled: torch.Tensor, requests: list[Request], healer: TokenHealer | None
    ) -> SamplingBatch:
        """The previous batch after every row took its sampled token; device ops only."""
        changes: dict[str, Any] = {"steps": previous.steps + 1}
        if previous.context_ids is not None and previous.context_lens is not None:
            changes["context_ids"] = self._append_history(previous.context_ids, sampled)
            changes["context_lens"] = previous.context_lens + 1
        if previous.watermark_prev_ids:
            changes["watermark_prev_ids"] = [(i, last_token(requests[i])) for i, _ in previous.watermark_prev_ids]
        if healer is not None:  # healing masks depend on the generated text so far
            changes["blocked"] = healer.blocked_rows(requests, self.vocab_size, self.device)
        return dataclasses.replace(previous, **changes)

    def _append_history(self, context_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """context_ids [B, capacity] padded with vocab_size, with each row's sampled id appended."""
        if self._max_length >= context_ids.shape[1]:
            padding = torch.full_like(context_ids[:, :CONTEXT_HEADROOM], self.vocab_size)
            context_ids = torch.cat([context_ids, padding], dim=1)
        context_ids.scatter_(1, self._positions, sampled[:, None])
        self._positions += 1
        self._max_length += 1
        return context_ids
