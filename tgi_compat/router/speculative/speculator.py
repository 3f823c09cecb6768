"""The scheduler's side of speculation: drafts for a step's decode chunks, and what verification accepted.

A decode chunk of a request that may draft (no penalty, watermark, healing or grammar: those read the
tokens on the host before each draw; no prompt logprobs) grows into a verify chunk: its last token and
k drafts, k + 1 positions whose logits are all sampled. The step's token at position j is exactly what a
plain decode would draw there (same logits, same noise counter), so the run of drafts that match is
accepted and the first token that differs is the step's last; the K/V slots of the rest go back to the
pool (the scheduler does that: tgi_compat/router/scheduler.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import Request
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.ngram import NgramProposer
from tgi_compat.router.speculative.policy import AcceptanceStats, choose_draft_lengths
from tgi_compat.router.speculative.proposer import DraftProposer
from tgi_compat.router.speculative.suffix import SuffixCorpus, SuffixProposer
from tgi_compat.router.step import SampledToken, ScheduledChunk, StepPlan


@dataclass(slots=True)
class _DraftState:
    proposer: DraftProposer
    num_seen: int = 0  # leading tokens of the request the proposer has been given
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)


@dataclass(slots=True)
class SpeculationCounters:
    """vLLM's spec_decode_* counters: verify chunks, drafts verified, drafts accepted (also per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        use_corpus = config.method == "suffix" and config.suffix.corpus_outputs > 0
        self.corpus = SuffixCorpus(config.suffix) if use_corpus else None
        self.counters = SpeculationCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self._states: dict[Request, _DraftState] = {}

    def add_drafts(self, plan: StepPlan, pool: KVSlotPool) -> None:
        """Turn the plan's eligible decode chunks into verify chunks, as the policy and the pool allow."""
        self._forget_finished()
        chosen = [(chunk, self._propose(chunk)) for chunk in plan.chunks if _may_draft(chunk)]
        chosen = [(chunk, drafts) for chunk, drafts in chosen if drafts]
        if not chosen:
            return
        caps = [len(drafts) for _, drafts in chosen]
        lengths = caps
        if (table := self.config.step_cost) is not None:
            rates = [self._states[chunk.request].acceptance.rate for chunk, _ in chosen]
            others = sum(c.num_tokens for c in plan.chunks) - len(chosen)
            num_sampled_others = sum(c.is_sampled for c in plan.chunks) - len(chosen)
            lengths = choose_draft_lengths(rates, caps, table, others, num_sampled_others)
        reserve = len(plan.chunks)  # a slot per request for the next step, whatever is drafted now
        for (chunk, drafts), num in zip(chosen, lengths):
            if num == 0 or pool.num_free_slots - num < reserve:
                continue
            slots = pool.allocate(num)
            assert slots is not None  # checked just above
            request = chunk.request
            chunk.num_tokens += num
            chunk.slots = chunk.slots + slots
            chunk.drafts = drafts[:num]
            request.slots.extend(slots)
            request.num_computed_tokens += num

    def verify(self, chunk: ScheduledChunk, token_ids: Sequence[int]) -> int:
        """How many of the chunk's drafts the step's tokens (one per position) accepted."""
        drafts = chunk.drafts or []
        accepted = 0
        while accepted < len(drafts) and token_ids[accepted] == drafts[accepted]:
            accepted += 1
        self._states[chunk.request].acceptance.record(len(drafts), accepted)
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

    def _propose(self, chunk: ScheduledChunk) -> list[int]:
        request = chunk.request
        state = self._states.get(request)
        if state is None:
            state = self._states[request] = _DraftState(self._new_proposer())
        state.proposer.extend(request.token_ids(state.num_seen, request.num_tokens))
        state.num_seen = request.num_tokens
        # Drafts past max_new_tokens are never kept: the step's own token is one of the remaining ones.
        room = request.params.max_new_tokens - request.num_output_tokens - 1
        return state.proposer.propose(min(self.config.num_speculative_tokens, room))

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
