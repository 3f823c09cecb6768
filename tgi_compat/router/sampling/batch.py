"""A step's per-row sampling parameters as device tensors (TGI's HeterogeneousNextTokenChooser's inputs).

Every parameter is a per-row tensor, and a processor's is None when no row of the batch needs it, so the
sampler skips it (tgi_compat/router/sampling/sampler.py). The per-row columns go to the device in two
copies, one float table and one int64 table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgi_compat.router.request import Request, SamplingParams

if TYPE_CHECKING:
    from tgi_compat.router.sampling.grammar import GrammarMask
    from tgi_compat.router.sampling.token_healing import TokenHealer


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters of the rows being sampled this step; None where no row needs a processor."""

    is_sampling: torch.Tensor  # [B] bool
    any_sampling: bool
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, generated tokens so far (the noise counter)
    temperature: torch.Tensor | None  # [B, 1]
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    top_p: torch.Tensor | None  # [B]
    typical_p: torch.Tensor | None  # [B]
    repetition_penalty: torch.Tensor | None  # [B, 1]
    frequency_penalty: torch.Tensor | None  # [B, 1]
    context_ids: torch.Tensor | None  # [B, L] prompt + generated, padded with vocab_size
    context_lens: torch.Tensor | None  # [B, 1] float
    watermark_prev_ids: list[tuple[int, int]]  # (row, previous token) of watermarked rows
    top_n: torch.Tensor | None  # [B] int64
    max_top_n: int
    blocked: torch.Tensor | None = None  # [B, V] bool: token healing forbids these ids (first of all)
    # logit_bias as flat (row, token id, bias) triples: [N] int64, [N] int64, [N] float32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    grammar: GrammarMask | None = None  # allowed tokens of the grammar-constrained rows (set per step)

    @property
    def changes_scores(self) -> bool:
        """Some processor of Sampler.process runs on the scores (the same conditions, in its order)."""
        return (
            self.blocked is not None
            or self.bias is not None
            or bool(self.watermark_prev_ids)
            or self.context_ids is not None
            or self.grammar is not None
            or self.temperature is not None
            or self.top_k is not None
            or self.top_p is not None
            or self.typical_p is not None
        )

    @classmethod
    def build(
        cls,
        requests: Sequence[Request],
        vocab_size: int,
        device: torch.device,
        healer: TokenHealer | None = None,
        context_headroom: int = 0,
    ) -> SamplingBatch:
        """`healer`: set when some request may heal its prompt.
        `context_headroom`: spare padded columns in context_ids (for appending ids in place)."""
        params = [r.params.sampling for r in requests]
        sampling = [p.is_sampling for p in params]
        top_n = [p.top_n_tokens for p in params]
        float_columns = [
            [p.temperature for p in params],
            [p.top_p for p in params],
            [p.typical_p for p in params],
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
        ]
        top_k = [p.top_k for p in params]
        seeds = [_as_int64(r.seed or 0) for r in requests]
        int_columns: list[Sequence[int]] = [sampling, seeds, [r.num_output_tokens for r in requests], top_k, top_n]
        floats = torch.tensor(float_columns, dtype=torch.float32).to(device, non_blocking=True)  # [5, B]
        ints = torch.tensor(int_columns, dtype=torch.int64).to(device, non_blocking=True)  # [5, B]
        is_sampling_row, seeds_row, steps_row, top_k_row, top_n_row = ints
        temperature, top_p, typical_p, rep, freq = float_columns
        has_penalty = any(v != 1.0 for v in rep) or any(v != 0.0 for v in freq)
        context_ids, context_lens = (
            _context(requests, vocab_size, device, context_headroom) if has_penalty else (None, None)
        )
        return cls(
            is_sampling=is_sampling_row.bool(),
            any_sampling=any(sampling),
            seeds=seeds_row,
            steps=steps_row,
            temperature=floats[0][:, None] if any(t != 1.0 for t in temperature) else None,
            top_k=top_k_row if any(k > 0 for k in top_k) else None,
            top_p=floats[1] if any(v < 1.0 for v in top_p) else None,
            typical_p=floats[2] if any(v < 1.0 for v in typical_p) else None,
            repetition_penalty=floats[3][:, None] if any(v != 1.0 for v in rep) else None,
            frequency_penalty=floats[4][:, None] if any(v != 0.0 for v in freq) else None,
            context_ids=context_ids,
            context_lens=context_lens,
            watermark_prev_ids=[(i, last_token(r)) for i, (r, p) in enumerate(zip(requests, params)) if p.watermark],
            top_n=top_n_row if any(top_n) else None,
            max_top_n=max(top_n, default=0),
            blocked=healer.blocked_rows(requests, vocab_size, device) if healer is not None else None,
            bias=_logit_bias(params, device),
        )


def is_plain_greedy(request: Request) -> bool:
    """The request's next token is the raw logits' argmax, its logprob theirs: no sampling (which any warper
    turns on: temperature, top-k, top-p, typical-p), top-n, processor (the conditions of SamplingBatch.build and
    changes_scores), grammar or token healing."""
    p = request.params.sampling
    return not (
        p.is_sampling
        or p.top_n_tokens
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.watermark
        or p.logit_bias
        or request.params.healing_prefix
        or request.params.grammar is not None
    )


def _logit_bias(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    triples = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if not triples:
        return None
    rows, tokens, biases = zip(*triples)
    return (
        torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(biases, dtype=torch.float32).to(device, non_blocking=True),
    )


def _as_int64(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def last_token(request: Request) -> int:
    """The id a watermark seeds its green list from: the newest generated one, else the prompt's last."""
    return request.output_ids[-1] if request.output_ids else request.params.prompt_ids[-1]


def _context(
    requests: Sequence[Request], vocab_size: int, device: torch.device, headroom: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L + headroom] prompt + generated ids padded with vocab_size, and [B, 1] float lengths.

    One flat copy of every id, spread into the padded table on the host."""
    lengths = [r.num_tokens for r in requests]
    ids = [t for r in requests for part in (r.params.prompt_ids, r.output_ids) for t in part]
    flat = torch.tensor(ids, dtype=torch.int64)
    length_column = torch.tensor(lengths, dtype=torch.int64)[:, None]
    padded = torch.full((len(requests), max(lengths, default=0) + headroom), vocab_size, dtype=torch.int64)
    padded[torch.arange(padded.shape[1]) < length_column] = flat
    return padded.to(device, non_blocking=True), length_column.to(torch.float32).to(device, non_blocking=True)
