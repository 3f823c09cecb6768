"""Token selection on the device, vectorised across the batch (TGI's HeterogeneousNextTokenChooser).

Order on each logits row (docs/contract.md §14): [token-healing mask] -> watermark -> repetition penalty -> frequency penalty ->
[grammar mask] -> temperature -> top-k -> top-p -> typical-p -> [grammar confinement] -> choose. Reported logprobs
are log_softmax of the final processed scores. Every parameter is a per-row tensor, and a processor runs only when some
row of the batch needs it, so an all-greedy batch costs one pass over its scores (tgi_compat/kernels/sampling/greedy_pick.py on a GPU).

Sampling is the exponential race argmax(p / E), E ~ Exp(1), written as argmax(logp + Gumbel).
The noise comes from a counter-based hash of (seed, generation step, token id) computed for the
whole batch at once, instead of one torch.Generator per request: a per-request generator forces a
Python loop per sampling row every step (docs/architecture.md §7), while the hash gives the same guarantees
(a seed reproduces its tokens, whatever else is in the batch and after a preemption). On a GPU every sampled step
chooses in one kernel that hashes each row's noise in registers (tgi_compat/kernels/sampling/race_pick.py) instead
of materialising [B, V] int64 hashes: one path, so a top-n row in the batch changes no other row's choice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgi_compat.kernels.sampling.race_pick import gumbel_keys, gumbel_noise_of_keys
from tgi_compat.router.sampling.batch import SamplingBatch
from tgi_compat.router.sampling.output import SamplerOutput, TopAlternatives

if TYPE_CHECKING:
    from tgi_compat.router.sampling.grammar import GrammarMask

WATERMARK_GAMMA = 0.5
WATERMARK_DELTA = 2.0
WATERMARK_HASH_KEY = 15485863
TIE_SLACK = 8  # extra top-n columns fetched so ties at the n-th value usually need no second pass


GreedyPick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
RacePick = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
MaskOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class SamplingKernels:
    """The device ops of token selection, chosen once for the sampler's device: the Triton kernels of
    tgi_compat/kernels/sampling/ on a GPU (where a GrammarMask is pinned host memory, read in place),
    their torch references elsewhere."""

    greedy_pick: GreedyPick  # scores [B, V] -> (ids [B] int64, [2, B] float64 ids and logprobs), one read
    grammar_apply: MaskOp  # (scores, bitmask, row index) -> scores
    grammar_confine: MaskOp
    # (scores, gumbel keys, is_sampling) -> as greedy_pick, the sampling rows racing: one read, no [B, V] noise.
    # None: the torch path (the CPU's, whose seeded tokens the tests pin)
    race_pick: RacePick | None

    @classmethod
    def for_device(cls, device: torch.device) -> SamplingKernels:
        from tgi_compat.kernels.sampling import grammar_apply, grammar_confine, greedy_pick, race_pick

        if device.type == "cuda":
            return cls(
                greedy_pick.greedy_pick, grammar_apply.grammar_apply, grammar_confine.grammar_confine,
                race_pick.race_pick,
            )  # fmt: skip
        return cls(
            greedy_pick.greedy_pick_ref, grammar_apply.grammar_apply_ref, grammar_confine.grammar_confine_ref, None
        )

    def apply_grammar(self, scores: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
        """-inf on every token the grammar forbids (in place on float32 [B, V] scores)."""
        return self.grammar_apply(scores.contiguous(), mask.bitmask, mask.row_index)

    def confine_grammar(self, scores: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
        """The last word on the constrained rows (in place), after every warper: whatever the request's
        parameters did to the scores, the token chosen from them is one the grammar allows.

        Extreme parameters break the masked scores: a temperature that is inf in float32 turns the
        masked -inf into NaN (-inf / inf), one that is 0 makes +inf (x / 0) whose log_softmax is NaN,
        and argmax takes NaN for the largest value, so the choice fell on the row's first NaN (token 0).
        Penalties can also push every allowed token to -inf. So NaN counts as -inf, +inf as the largest
        float, and a row left without a finite score takes its lowest allowed id (greedy or sampled).
        No processor after the mask turns -inf into a number, so forbidden tokens stay -inf. On the device
        with no host sync; the bitmask is not applied again."""
        return self.grammar_confine(scores.contiguous(), mask.bitmask, mask.row_index)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.kernels = SamplingKernels.for_device(self.device)
        self._green_lists: OrderedDict[int, torch.Tensor] = OrderedDict()  # prev token -> green ids

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] (float32 logits may be modified in place) -> chosen ids, their logprobs, top-n."""
        all_greedy = not batch.any_sampling and batch.top_n is None
        # an all-greedy batch that no processor changes reads the model's logits as they are, in their dtype
        scores = logits if all_greedy and not batch.changes_scores else self.process(logits.float(), batch)
        if all_greedy:  # no [B, V] logprobs needed
            token_ids, packed = self.kernels.greedy_pick(scores)
            return SamplerOutput(token_ids, packed[1], None, all_logprobs=scores, packed=packed)
        race_pick = self.kernels.race_pick
        if race_pick is not None:  # the race from one read of the scores, whatever else the batch asks
            token_ids, packed = race_pick(scores, gumbel_keys(batch.seeds, batch.steps), batch.is_sampling)
            if batch.top_n is None:
                return SamplerOutput(token_ids, packed[1], None, all_logprobs=scores, packed=packed)
        else:
            token_ids = scores.argmax(dim=-1)
        logprobs = torch.log_softmax(scores, dim=-1)  # [B, V]
        if race_pick is None and batch.any_sampling:
            raced = (logprobs + gumbel_noise(batch.seeds, batch.steps, logprobs.shape[-1])).argmax(dim=-1)
            token_ids = torch.where(batch.is_sampling, raced, token_ids)
        # (with the kernel, top-n rows change no row's choice: a seed's tokens never depend on its batch)
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
            scores = self.kernels.apply_grammar(scores, batch.grammar)
        if batch.temperature is not None:
            scores = scores / batch.temperature
        if batch.top_k is not None:
            scores = apply_top_k(scores, batch.top_k)
        if batch.top_p is not None:
            scores = apply_top_p(scores, batch.top_p)
        if batch.typical_p is not None:
            scores = apply_typical_p(scores, batch.typical_p)
        if batch.grammar is not None:  # extreme parameters can leave NaN, +inf or nothing on a constrained row
            scores = self.kernels.confine_grammar(scores, batch.grammar)
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
    return gumbel_noise_of_keys(gumbel_keys(seeds, steps), vocab_size)


def score_prompt(logits: torch.Tensor, next_ids: torch.Tensor, top_n: torch.Tensor, max_n: int) -> SamplerOutput:
    """Prompt logprobs: logits [P, V] at prompt positions, next_ids [P] the tokens they predict,
    top_n [P] alternatives wanted per row (max_n of them at most).

    Scored under the raw model distribution (no penalties or warpers), as TGI's prefill does.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, next_ids[:, None]).squeeze(1)
    top = top_n_with_ties(logprobs, top_n, max_n) if max_n > 0 else None
    return SamplerOutput(next_ids, chosen, top, all_logprobs=logprobs)
