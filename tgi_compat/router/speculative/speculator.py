"""The scheduler's side of speculation: drafts for a step's decode chunks, and what verification accepted.

A decode chunk of a request that may draft (no penalty, watermark, healing or grammar: those read the
tokens on the host before each draw; no prompt logprobs) grows into a verify chunk: its last token and
k drafts, k + 1 positions whose logits are all sampled. The step's token at position j is exactly what a
plain decode would draw there (same logits, same noise counter), so the run of drafts that match is
accepted and the first token that differs is the step's last; the K/V slots of the rest go back to the
pool (the scheduler does that: tgi_compat/router/scheduler.py).

A step of only drafting requests, no more than `config.uniform_max_batch`, gives every request the same
draft length k (padded with repeats of its last token where its proposer has fewer): the runner replays it as
a verify CUDA graph of k + 1 tokens per request, where a mixed-length step would run eager (~2-3x the time
at batch 1). Padding drafts are verified like any other (accepted only where they are the model's token).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import msgspec
import torch

from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import Request
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.eagle3 import Eagle3Drafter, Eagle3Proposer, propose_together
from tgi_compat.router.speculative.estimate import ServerAcceptance, StepPrior
from tgi_compat.router.speculative.ngram import NgramProposer
from tgi_compat.router.speculative.policy import (
    AcceptanceStats,
    HeadCost,
    StepCostTable,
    choose_draft_lengths,
    choose_uniform_draft_length,
    drafts_may_pay,
)
from tgi_compat.router.speculative.proposer import DraftProposer
from tgi_compat.router.speculative.suffix import SuffixCorpus, SuffixProposer
from tgi_compat.router.step import SampledToken, ScheduledChunk, StepPlan

_NO_DRAFTS_YET = AcceptanceStats()  # a request that has not drafted yet: its rate is the prior


@dataclass(slots=True)
class _DraftState:
    proposer: DraftProposer
    hidden: Eagle3Proposer | None = None  # the proposer again where it reads the target's hidden states
    num_seen: int = 0  # leading tokens of the request the proposer has been given
    num_proposed: int = 0  # of the drafts verified this step, those the proposer made (the rest: padding)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)


@dataclass(slots=True)
class SpeculationCounters:
    """vLLM's spec_decode_* counters: verify chunks, drafts verified, drafts accepted (also per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Eagle3Drafter | None = None) -> None:
        if (config.method == "eagle3") != (drafter is not None):
            raise ValueError("an eagle3 speculator needs its loaded head, and only it")
        self.config = config
        self.drafter = drafter
        # the proposer's own time per drafting step, weighed with the step's (model-free proposers: none)
        self.head_cost: HeadCost | None = None if drafter is None else drafter.cost
        use_corpus = config.method == "suffix" and config.suffix.corpus_outputs > 0
        self.corpus = SuffixCorpus(config.suffix) if use_corpus else None
        self.counters = SpeculationCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self._states: dict[Request, _DraftState] = {}
        self.estimate = ServerAcceptance()  # every request's prior (estimate.py)
        self._rng = random.Random(0)  # synthetic acceptance's draws
        self._keeps_hidden = True  # EAGLE-3: the last `may_pay` answer (rows are kept only where drafts may pay)

    def may_pay(self, running: Sequence[Request]) -> bool:
        """Whether drafts could pay in a step of these requests: False where the step-cost table turns them
        off whatever the proposers find (a large batch) at their acceptance, which starts from the server-wide
        estimate (none accepted lately: ~0, unless an exploration is due), so the engine keeps overlap scheduling
        for that step (with no drafts: they need the tokens of the step before on the host). Asked before the
        step's `add_drafts`; a False ends the step for the estimate."""
        table = self.config.step_cost
        if table is None or not running:
            self._keeps_hidden = True
            return True
        step = self._step_prior(running, table)
        if not step.drafts:  # (no `add_drafts` this step: it ends here for the estimate)
            self.estimate.end_step(step)
        # (an exploring head drafts from the rows since the last step that drafts may pay: where only the optimistic
        # rate pays, keeping every step's rows would pin each step's copy for up to `explore_every` steps)
        self._keeps_hidden = step.drafts
        return step.drafts

    def _step_prior(self, requests: Sequence[Request], table: StepCostTable) -> StepPrior:
        """The step's prior from the server-wide estimate, where drafts may pay for some request (its own
        acceptance so far, from that prior)."""
        num_drafts, head = self.config.num_speculative_tokens, self.head_cost

        def pays(prior: float) -> bool:
            best = max(self._rate(request, prior) for request in requests)
            return drafts_may_pay(len(requests), best, num_drafts, table, head)

        return self.estimate.step_prior(pays)

    def _rate(self, request: Request, prior: float) -> float:
        state = self._states.get(request)
        return (state.acceptance if state is not None else _NO_DRAFTS_YET).rate(prior)

    def observe(self, plan: StepPlan, aux_hidden: torch.Tensor) -> None:
        """A step's auxiliary hidden states [its tokens, 3 * H] (EAGLE-3), rows in chunk order: each request
        that may draft keeps those of its positions."""
        if not self._keeps_hidden:  # (a batch that drafts nothing keeps no rows: the head lacks their context later)
            return
        offset = 0
        for chunk in plan.chunks:
            rows, offset = aux_hidden[offset : offset + chunk.num_tokens], offset + chunk.num_tokens
            request = chunk.request
            if request.reads_own_tokens_to_sample or request.params.grammar is not None or request.is_finished:
                continue  # (never drafts)
            state = self._states.get(request) or self._new_state(request)
            if state.hidden is not None:
                state.hidden.observe(chunk.start, rows)

    def add_drafts(self, plan: StepPlan, pool: KVSlotPool) -> None:
        """Turn the plan's eligible decode chunks into verify chunks, as the policy and the pool allow."""
        self._forget_finished()
        eligible = [chunk for chunk in plan.chunks if _may_draft(chunk)]
        table = self.config.step_cost
        if table is None or not eligible:  # (without a table every proposal is verified: TGI's fixed N)
            step = StepPrior(self.estimate.rate, drafts=table is None)
        else:
            step = self._step_prior([chunk.request for chunk in eligible], table)
        self.estimate.end_step(step)  # (once per step: here, or in `may_pay` where it turned drafts off)
        if self.head_cost is not None and not step.drafts:  # (the head's time is spent proposing)
            return
        if eligible and len(eligible) == len(plan.chunks) <= self.config.uniform_max_batch:
            self._add_uniform_drafts(plan, pool, step.rate)
            return
        chosen = list(zip(eligible, self._propose_all(eligible)))
        chosen = [(chunk, drafts) for chunk, drafts in chosen if drafts]
        if not chosen:
            return
        caps = [len(drafts) for _, drafts in chosen]
        lengths = caps
        if table is not None:
            rates = [self._rate(chunk.request, step.rate) for chunk, _ in chosen]
            others = sum(c.num_tokens for c in plan.chunks) - len(chosen)
            num_sampled_others = sum(c.is_sampled for c in plan.chunks) - len(chosen)
            lengths = choose_draft_lengths(rates, caps, table, others, num_sampled_others, self.head_cost)
        reserve = len(plan.chunks)  # a slot per request for the next step, whatever is drafted now
        for (chunk, drafts), num in zip(chosen, lengths):
            if num == 0 or pool.num_free_slots - num < reserve:
                continue
            self._grow(chunk, drafts[:num], min(num, self._states[chunk.request].num_proposed), pool)

    def _add_uniform_drafts(self, plan: StepPlan, pool: KVSlotPool, prior: float) -> None:
        """Every chunk of the plan may draft: one length k for all (a verify graph's shape), or none."""
        chunks, table = plan.chunks, self.config.step_cost
        max_length = min(self.config.num_speculative_tokens, *(self._room(chunk.request) for chunk in chunks))
        asked = None
        if self.head_cost is not None and table is not None:  # a head drafts what it is asked: ask for k only
            rates = [self._rate(chunk.request, prior) for chunk in chunks]
            asked = choose_uniform_draft_length(rates, [max_length] * len(chunks), max_length, table, self.head_cost)
            if asked <= 0:
                return
            max_length = asked
        proposals = self._propose_all(chunks, asked)
        caps = [self._states[chunk.request].num_proposed for chunk in chunks]
        rates = [self._rate(chunk.request, prior) for chunk in chunks]
        k = choose_uniform_draft_length(rates, caps, max_length, table, self.head_cost)
        if k <= 0 or pool.num_free_slots - k * len(chunks) < len(chunks):  # (a slot each for the next step)
            return
        for chunk, drafts, cap in zip(chunks, proposals, caps):
            self._grow(chunk, _padded(drafts, k, _last_token(chunk.request)), min(cap, k), pool)

    def _grow(self, chunk: ScheduledChunk, drafts: list[int], num_proposed: int, pool: KVSlotPool) -> None:
        """The decode chunk becomes a verify chunk of its token and `drafts` (the first `num_proposed` the
        proposer's); the pool has the slots."""
        num = len(drafts)
        slots = pool.allocate(num)
        assert slots is not None  # the caller checked
        request = chunk.request
        chunk.num_tokens += num
        chunk.slots = chunk.slots + slots
        chunk.drafts = drafts
        request.slots.extend(slots)
        request.num_computed_tokens += num
        self._states[request].num_proposed = num_proposed

    def verify(self, chunk: ScheduledChunk, token_ids: Sequence[int]) -> int:
        """How many of the chunk's drafts the step's tokens (one per position) accepted; with synthetic
        acceptance, a draw from its distribution instead."""
        drafts = chunk.drafts or []
        state = self._states[chunk.request]
        accepted = 0
        if (synthetic := self.config.synthetic_acceptance) is not None:
            accepted = synthetic.draw(len(drafts), self._rng)
        else:
            while accepted < len(drafts) and token_ids[accepted] == drafts[accepted]:
                accepted += 1
        # the policy learns from the proposer's drafts only (a padding draft says nothing of its rate)
        num_proposed = min(state.num_proposed, len(drafts))
        state.acceptance.record(num_proposed, min(accepted, num_proposed))
        self.estimate.record(num_proposed, min(accepted, num_proposed))
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += len(drafts)
        counters.num_accepted_tokens += accepted
        for position in range(accepted):
            counters.accepted_per_position[position] += 1
        return accepted

    def accept(
        self,
        chunk: ScheduledChunk,
        tokens: list[SampledToken],
        append: Callable[[Request, SampledToken], TokenEvent],
        pool: KVSlotPool,
    ) -> list[TokenEvent]:
        """A verify chunk's tokens up to its first that differs from the drafts, each appended (`append`: the
        scheduler's) as its own event as in TGI, until one ends the request; the K/V slots of the positions past
        them go straight back to the pool."""
        request = chunk.request
        num_accepted = self.verify(chunk, [t.token_id for t in tokens])
        if self.config.synthetic_acceptance is not None:  # the accepted drafts stand in for the model's tokens
            drafts = chunk.drafts or []
            tokens = [msgspec.structs.replace(t, token_id=d) for t, d in zip(tokens, drafts[:num_accepted])] + tokens[
                num_accepted:
            ]
        events = []
        for j, token in enumerate(tokens[: num_accepted + 1]):
            request.num_kv_written = chunk.start + 1 + j  # the K/V before token j (never past the tokens kept)
            events.append(append(request, token))
            if request.is_finished:  # (its slots are all released)
                return events
        keep = chunk.start + 1 + num_accepted  # the newest token has no K/V yet, as after a plain decode
        pool.free(request.slots[keep:])
        del request.slots[keep:]
        request.num_computed_tokens = keep
        return events

    def num_accepted(self, request: Request) -> int:
        """The request's accepted drafts so far (TGI's tgi_request_skipped_tokens)."""
        state = self._states.get(request)
        return 0 if state is None else state.acceptance.accepted

    def _propose_all(self, chunks: Sequence[ScheduledChunk], max_tokens: int | None = None) -> list[list[int]]:
        """Each chunk's drafts, up to `max_tokens` (an EAGLE-3 head drafts for all of them at once)."""
        states, limits = [], []
        for chunk in chunks:
            request = chunk.request
            state = self._states.get(request) or self._new_state(request)
            state.proposer.extend(request.token_ids(state.num_seen, request.num_tokens))
            state.num_seen = request.num_tokens
            states.append(state)
            limits.append(min(max_tokens or self.config.num_speculative_tokens, self._room(request)))
        if self.drafter is not None:
            heads = [cast(Eagle3Proposer, state.hidden) for state in states]
            proposals = propose_together(self.drafter.head, heads, limits)
        else:
            proposals = [state.proposer.propose(limit) for state, limit in zip(states, limits)]
        for chunk, state, limit, drafts in zip(chunks, states, limits, proposals):
            state.num_proposed = len(drafts)
            if self.config.synthetic_acceptance is not None:  # random weights match nothing: always k drafts
                drafts[:] = _padded(drafts, limit, _last_token(chunk.request))
                state.num_proposed = len(drafts)
        return proposals

    @staticmethod
    def _room(request: Request) -> int:
        """Drafts past max_new_tokens are never kept: the step's own token is one of the remaining ones."""
        return request.params.max_new_tokens - request.num_output_tokens - 1

    def _new_state(self, request: Request) -> _DraftState:
        if self.drafter is not None:
            proposer = Eagle3Proposer(self.drafter.head)
            state = _DraftState(proposer, hidden=proposer)
        else:
            state = _DraftState(self._new_proposer())
        self._states[request] = state
        return state

    def _new_proposer(self) -> DraftProposer:
        if self.config.method == "suffix":
            return SuffixProposer(self.config.suffix, self.corpus)
        return NgramProposer(self.config.ngram)

    def _forget_finished(self) -> None:
        finished = [request for request in self._states if request.is_finished]
        for request in finished:
            del self._states[request]
            if self.corpus is not None:
                self.corpus.add(request.output_ids)


def _padded(drafts: list[int], length: int, last_token: int) -> list[int]:
    """`drafts` cut or padded to `length` with repeats of its last token (the sequence's, when empty)."""
    return drafts[:length] + [drafts[-1] if drafts else last_token] * (length - len(drafts))


def _last_token(request: Request) -> int:
    return request.token_ids(request.num_tokens - 1, request.num_tokens)[0]


def _may_draft(chunk: ScheduledChunk) -> bool:
    """A plain decode of a request whose sampling reads nothing on the host between tokens."""
    request = chunk.request
    return (
        chunk.num_tokens == 1
        and chunk.is_sampled
        and chunk.start > 0
        and chunk.num_prompt_logprob_rows is None
        and request.num_pending_tokens == 0
        and not request.reads_own_tokens_to_sample
        and request.params.grammar is None
    )
