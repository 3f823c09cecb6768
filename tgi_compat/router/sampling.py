"""Token selection on the device, vectorised across the batch (TGI's HeterogeneousNextTokenChooser).

Order on each logits row (docs/contract.md §14): [token-healing mask] -> watermark -> repetition penalty -> frequency penalty ->
[grammar mask] -> temperature -> top-k -> top-p -> typical-p -> [grammar confinement] -> choose. Reported logprobs
are log_softmax of the final processed scores. Every parameter is a per-row tensor, and a processor runs only when some
row of the batch needs it, so an all-greedy batch costs one pass over its scores (tgi_compat/kernels/sampling/greedy_pick.py on a GPU).

Sampling is the exponential race argmax(p / E), E ~ Exp(1), written as argmax(logp + Gumbel).
The noise comes from a counter-based hash of (seed, generation step, token id) computed for the
whole batch at once, instead of one torch.Generator per request: a per-request generator forces a
Python loop per sampling row every step (docs/architecture.md §7), while the hash gives the same guarantees
(a seed reproduces its tokens, whatever else is in the batch and after a preemption).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgi_compat.router import copy_streams
from tgi_compat.router.outputs import TopToken
from tgi_compat.router.request import Request, SamplingParams
from tgi_compat.router.step import SampledToken

if TYPE_CHECKING:
    from tgi_compat.router.grammar import GrammarMask

WATERMARK_GAMMA = 0.5
WATERMARK_DELTA = 2.0
WATERMARK_HASH_KEY = 15485863
TIE_SLACK = 8  # extra top-n columns fetched so ties at the n-th value usually need no second pass

_MASK32 = 0xFFFFFFFF
_LARGEST_BELOW_ONE = 1.0 - 2.0**-24  # the float32 just under 1


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
        cls, requests: Sequence[Request], vocab_size: int, device: torch.device, healer=None, context_headroom: int = 0
    ) -> SamplingBatch:
        """`healer`: a tgi_compat.router.token_healing.TokenHealer, when some request may heal its prompt.
        `context_headroom`: spare padded columns in context_ids (for appending ids in place).

        Every per-row column goes to the device in two copies (one float, one int64 table)."""
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
        temperature, top_p, typical_p, rep, freq = float_columns
        has_penalty = any(v != 1.0 for v in rep) or any(v != 0.0 for v in freq)
        context_ids, context_lens = (
            _context(requests, vocab_size, device, context_headroom) if has_penalty else (None, None)
        )
        return cls(
            is_sampling=ints[0].bool(),
            any_sampling=any(sampling),
            seeds=ints[1],
            steps=ints[2],
            temperature=floats[0][:, None] if any(t != 1.0 for t in temperature) else None,
            top_k=ints[3] if any(k > 0 for k in top_k) else None,
            top_p=floats[1] if any(v < 1.0 for v in top_p) else None,
            typical_p=floats[2] if any(v < 1.0 for v in typical_p) else None,
            repetition_penalty=floats[3][:, None] if any(v != 1.0 for v in rep) else None,
            frequency_penalty=floats[4][:, None] if any(v != 0.0 for v in freq) else None,
            context_ids=context_ids,
            context_lens=context_lens,
            watermark_prev_ids=[(i, _last_token(r)) for i, (r, p) in enumerate(zip(requests, params)) if p.watermark],
            top_n=ints[4] if any(top_n) else None,
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


def _logit_bias(params: Sequence[SamplingParams], device: torch.device):
    triples = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if not triples:
        return None
    rows, tokens, biases = zip(*triples)
    return (
        torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(biases, dtype=torch.float32).to(device, non_blocking=True),
    )


@dataclass(slots=True)
class TopAlternatives:
    """Each row's top-n alternatives, ties with the n-th kept (top_n_with_ties)."""

    ids: torch.Tensor  # [B, K]
    logprobs: torch.Tensor  # [B, K]
    counts: torch.Tensor  # [B] int64: how many alternatives each row reports


@dataclass(slots=True)
class SamplerOutput:
    """Device tensors of one step, packed for a single device-to-host copy."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, or float64 where the choice packed them (a view of `packed`)
    top: TopAlternatives | None  # only when some row asked for top-n tokens
    all_logprobs: torch.Tensor  # [B, V], read again only when ties overflow the top_ids columns (with top-n)
    packed: torch.Tensor | None = None  # [2, B] float64 ids and logprobs, where the choice wrote them so

    def to_host(self) -> list[SampledToken]:
        return self.start_copy().rows()

    def start_copy(self) -> SampledRows:
        """Start the step's one device-to-host copy; SampledRows.rows() waits for it."""
        if self.top is None:  # the usual step: ids and logprobs only
            packed = self.packed
            if packed is None:
                packed = torch.stack([self.token_ids.to(torch.float64), self.logprobs.to(torch.float64)])  # [2, B]
        else:
            parts = [self.token_ids, self.logprobs, self.top.counts, self.top.ids, self.top.logprobs]
            num_rows = self.token_ids.shape[0]
            packed = torch.cat([p.reshape(num_rows, -1).to(torch.float64) for p in parts], dim=1)  # [B, 3 + 2K]
        return SampledRows(self, DeviceToHost(packed))

    def to_token(self, i: int, values: list[float]) -> SampledToken:
        token = SampledToken(int(values[0]), values[1])
        if self.top is None or (count := int(values[2])) == 0:
            return token
        width = self.top.ids.shape[1]
        if count > width:  # rare: more ties than fetched columns; a second copy for this row only
            row_values, row_ids = self.all_logprobs[i].topk(count)
            pairs = zip(row_ids.tolist(), row_values.tolist())
        else:
            pairs = zip(values[3 : 3 + count], values[3 + width : 3 + width + count])
        token.top_tokens = [TopToken(int(t), float(v)) for t, v in pairs]
        return token


class DeviceToHost:
    """A device tensor's copy to the host, started at once and read later: into pinned memory on a
    GPU, on a side stream, so that neither the host nor the work queued after it waits for the copy."""

    def __init__(self, values: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if values.device.type != "cuda":
            self._host = values
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._ready = copy_streams.download(values, self._host)

    def tolist(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


@dataclass(slots=True)
class SampledRows:
    """A step's sampled rows on their way to the host."""

    output: SamplerOutput
    copy: DeviceToHost

    def rows(self) -> list[SampledToken]:
        """Plain Python objects per row; waits for the copy."""
        values = self.copy.tolist()
        if self.output.top is None:
            ids, logprobs = values
            return list(map(SampledToken, map(int, ids), logprobs))
        return [self.output.to_token(i, row) for i, row in enumerate(values)]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._green_lists: OrderedDict[int, torch.Tensor] = OrderedDict()  # prev token -> green ids

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] (float32 logits may be modified in place) -> chosen ids, their logprobs, top-n."""
        all_greedy = not batch.any_sampling and batch.top_n is None
        # an all-greedy batch that no processor changes reads the model's logits as they are, in their dtype
        scores = logits if all_greedy and not batch.changes_scores else self.process(logits.float(), batch)
        if all_greedy:  # no [B, V] logprobs needed
            token_ids, packed = greedy_choice(scores)
            return SamplerOutput(token_ids, packed[1], None, all_logprobs=scores, packed=packed)
        token_ids = scores.argmax(dim=-1)
        logprobs = torch.log_softmax(scores, dim=-1)  # [B, V]
        if batch.any_sampling:
            raced = (logprobs + gumbel_noise(batch.seeds, batch.steps, logprobs.shape[-1])).argmax(dim=-1)
            token_ids = torch.where(batch.is_sampling, raced, token_ids)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        top = top_n_with_ties(logprobs, batch.top_n, batch.max_top_n) if batch.top_n is not None else None
        return SamplerOutput(token_ids, chosen, top, all_logprobs=logprobs)

    def process(self, scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.blocked is not None:  # token healing: only ids that re-cover the removed prompt text
            scores = scores.masked_fill(batch.blocked, float("-inf"))
        if batch.bias is not None:  # logit_bias acts on the model's raw scores, as in OpenAI's API
            scores = scores.index_put(batch.bias[:2], batch.bias[2], accumulate=True)
        if batch.watermark_prev_ids:
            self._apply_watermark(scores, batch.watermark_prev_ids)
        if batch.context_ids is not None:
            scores = apply_penalties(scores, batch)
        if batch.grammar is not None:  # TGI's grammar processor runs after the penalties
            scores = batch.grammar.apply(scores)
        if batch.temperature is not None:
            scores = scores / batch.temperature
        if batch.top_k is not None:
            scores = apply_top_k(scores, batch.top_k)
        if batch.top_p is not None:
            scores = apply_top_p(scores, batch.top_p)
        if batch.typical_p is not None:
            scores = apply_typical_p(scores, batch.typical_p)
        if batch.grammar is not None:  # extreme parameters can leave NaN, +inf or nothing on a constrained row
            scores = batch.grammar.confine(scores)
        return scores

    def _apply_watermark(self, scores: torch.Tensor, rows: list[tuple[int, int]]) -> None:
        # One randperm per distinct previous token (cached): the green list depends on nothing else.
        for row, prev in rows:
            scores[row, self._green_list(prev, scores.shape[-1])] += WATERMARK_DELTA

    def _green_list(self, prev_token: int, vocab_size: int) -> torch.Tensor:
        if (green := self._green_lists.get(prev_token)) is None:
            green = watermark_green_list(prev_token, vocab_size).to(self.device)
            self._green_lists[prev_token] = green
            if len(self._green_lists) > 4096:
                self._green_lists.popitem(last=False)
        return green


def watermark_green_list(prev_token: int, vocab_size: int) -> torch.Tensor:
    """Kirchenbauer et al.: ids whose logits get +delta after `prev_token`."""
    generator = torch.Generator(device="cpu").manual_seed(WATERMARK_HASH_KEY * prev_token)
    permutation = torch.randperm(vocab_size, generator=generator)
    return permutation[: int(vocab_size * WATERMARK_GAMMA)]


def greedy_choice(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and its logprob: (ids [B] int64, [2, B] float64 of ids and logprobs). One read of the
    scores on a GPU (tgi_compat/kernels/sampling/greedy_pick.py) instead of torch's five."""
    from tgi_compat.kernels.sampling.greedy_pick import (  # imported on first use, like the grammar kernels
        greedy_pick,
        greedy_pick_ref,
    )

    return greedy_pick(scores) if scores.is_cuda else greedy_pick_ref(scores)


def apply_penalties(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (set semantics, HF/CTRL) then TGI's frequency penalty p * count / context_len."""
    context_ids, context_lens = batch.context_ids, batch.context_lens
    if context_ids is None or context_lens is None:  # built only when some row has a penalty
        return scores
    num_rows, vocab = scores.shape
    counts = torch.zeros(num_rows, vocab + 1, dtype=scores.dtype, device=scores.device)  # +1: pad column
    counts.scatter_add_(1, context_ids, torch.ones_like(context_ids, dtype=scores.dtype))
    counts = counts[:, :vocab]
    if batch.repetition_penalty is not None:
        penalty = batch.repetition_penalty
        penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores = torch.where(counts > 0, penalised, scores)
    if batch.frequency_penalty is not None:
        scores = scores - batch.frequency_penalty * counts / context_lens
    return scores


def apply_top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep scores >= the k-th largest (ties kept); rows with k == 0 are untouched."""
    vocab = scores.shape[-1]
    max_k = int(min(vocab, top_k.max().item())) if top_k.device.type == "cpu" else vocab
    top_values = scores.topk(max_k, dim=-1).values  # [B, max_k], descending
    kth = top_values.gather(1, (top_k.clamp(min=1, max=max_k) - 1)[:, None])
    remove = (scores < kth) & (top_k > 0)[:, None]
    return scores.masked_fill(remove, float("-inf"))


def apply_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop the low tail whose cumulative mass is <= 1 - top_p; always keep the top token."""
    sorted_scores, order = scores.sort(dim=-1)  # ascending
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)[:, None]
    remove_sorted[:, -1] = False
    remove_sorted &= (top_p < 1.0)[:, None]
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def apply_typical_p(scores: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy."""
    logp = torch.log_softmax(scores, dim=-1)
    probs = logp.exp()
    entropy = -(logp * probs).nan_to_num().sum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    sorted_distance, order = distance.sort(dim=-1)
    cumulative = scores.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last_kept = (cumulative < typical_p[:, None]).sum(dim=-1).clamp(max=scores.shape[-1] - 1)
    remove_sorted = sorted_distance > sorted_distance.gather(1, last_kept[:, None])
    remove_sorted[:, 0] = False
    remove_sorted &= (typical_p < 1.0)[:, None]
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def top_n_with_ties(logprobs: torch.Tensor, top_n: torch.Tensor, max_n: int) -> TopAlternatives:
    """Top-n alternatives per row, sorted; every token tied with the n-th value counts too.

    A -inf n-th value (fewer than n tokens survived top-k/top-p/typical-p) is no tie: only the
    finite survivors are reported, as TGI does, so a row never carries the whole vocabulary.
    Returns ids and logprobs [B, K] (K = max_n + TIE_SLACK, capped at vocab) and counts [B]; a row
    whose count exceeds K is completed on the host (see SamplerOutput.to_token).
    """
    k = min(logprobs.shape[-1], max_n + TIE_SLACK)
    values, ids = logprobs.topk(k, dim=-1)
    nth = values.gather(1, (top_n.clamp(min=1, max=k) - 1)[:, None])
    # A masked (-inf) n-th value ties with every masked token: TGI counts only finite ones then.
    nth = nth.clamp(min=torch.finfo(logprobs.dtype).min)
    counts = (logprobs >= nth).sum(dim=-1)
    counts = torch.where(top_n > 0, counts, torch.zeros_like(counts))
    return TopAlternatives(ids, values, counts)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-log(-log U) with U from a 32-bit hash of (seed, step, token id); [B] x [B] -> [B, V]."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(_mix32(lo ^ _mix32(hi)) ^ ((steps * 0x9E3779B1) & _MASK32))  # [B]
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32((key[:, None] + token * 0x2C1B3C6D) & _MASK32) ^ key[:, None])  # [B, V]
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # The top value (2**24 - 0.5) / 2**24 rounds to 1.0 in float32, whose noise is +inf: that token would
    # win whatever its score, and a masked one (-inf + inf = NaN) would win argmax too. Keep U below 1.
    uniform = uniform.clamp_(max=_LARGEST_BELOW_ONE)
    return -torch.log(-torch.log(uniform))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors; multipliers < 2**31 so products never overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0x27D4EB2D) & _MASK32
    return x ^ (x >> 16)


def _as_int64(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _last_token(request: Request) -> int:
    return request.output_ids[-1] if request.output_ids else request.params.prompt_ids[-1]


def _context(requests: Sequence[Request], vocab_size: int, device: torch.device, headroom: int = 0):
    """[B, L + headroom] prompt + generated ids padded with vocab_size, and [B, 1] float lengths.

    One flat copy of every id, spread into the padded table on the host."""
    lengths = [r.num_tokens for r in requests]
    ids = [t for r in requests for part in (r.params.prompt_ids, r.output_ids) for t in part]
    flat = torch.tensor(ids, dtype=torch.int64)
    length_column = torch.tensor(lengths, dtype=torch.int64)[:, None]
    padded = torch.full((len(requests), max(lengths, default=0) + headroom), vocab_size, dtype=torch.int64)
    padded[torch.arange(padded.shape[1]) < length_column] = flat
    return padded.to(device, non_blocking=True), length_column.to(torch.float32).to(device, non_blocking=True)


def score_prompt(logits: torch.Tensor, next_ids: torch.Tensor, top_n: torch.Tensor, max_n: int) -> SamplerOutput:
    """Prompt logprobs: logits [P, V] at prompt positions, next_ids [P] the tokens they predict,
    top_n [P] alternatives wanted per row (max_n of them at most).

    Scored under the raw model distribution (no penalties or warpers), as TGI's prefill does.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, next_ids[:, None]).squeeze(1)
    top = top_n_with_ties(logprobs, top_n, max_n) if max_n > 0 else None
    return SamplerOutput(next_ids, chosen, top, all_logprobs=logprobs)
