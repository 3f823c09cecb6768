"""Beam search (LightLLM `--beam_mode`, vLLM's `use_beam_search`), scored as transformers'
`generate(num_beams=...)` scores it, over the ordinary engine.

As in vLLM v1, beams are not an engine mode: every step asks the engine for one token of each live beam, whose
prompt is the request's prompt plus the beam's tokens, with its top-K next-token logprobs (K = 2 x beams, or
more with several EOS ids). The requests of a step run in one batch, and each beam's KV comes from the prefix
cache, shared with its parent: only the newest token is computed. `BeamSearch` is the host-side bookkeeping,
transformers' algorithm step for step (its vectorized `_beam_search` for one prompt):

- candidates: the K best (beam score + logprob) over all live beams;
- a candidate that ends in EOS, or reaches `max_new_tokens`, finishes if it ranks among the first `num_beams`,
  scored sum_logprobs / generated_len ** length_penalty; the best `num_beams` finished hypotheses are kept;
- the best `num_beams` candidates that did not finish run on;
- it stops when every top candidate finished, when `early_stopping=True` and `num_beams` hypotheses are done,
  or when no running beam can beat the worst kept hypothesis (transformers' heuristic: at the current length,
  or for `"never"` with a positive length penalty at the maximal length).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from tgi_compat.api.serving.one_step import final_event
from tgi_compat.router.client_api import EngineClient
from tgi_compat.router.request import GenerateRequest, SamplingParams

EarlyStopping = bool | str  # True, False or "never", as transformers defines them


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    num_beams: int
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def num_candidates(self) -> int:
        """K: candidates kept a step, so that num_beams survive even if the others all end in EOS."""
        return max(2, 1 + len(self.eos_token_ids)) * self.num_beams


@dataclass(slots=True)
class Beam:
    token_ids: list[int]  # generated so far (an EOS included, for a finished hypothesis)
    logprobs: list[float]  # of each token
    score: float  # running beams: the sum of the logprobs; finished hypotheses: with the length penalty

    @property
    def cum_logprob(self) -> float:
        return sum(self.logprobs)

    def then(self, token: int, logprob: float, score: float) -> Beam:
        return Beam([*self.token_ids, token], [*self.logprobs, logprob], score)


@dataclass(slots=True)
class BeamSearch:
    params: BeamSearchParams
    running: list[Beam] = field(default_factory=lambda: [Beam([], [], 0.0)])  # best first
    finished: list[Beam] = field(default_factory=list)  # best first, at most num_beams
    is_done: bool = False

    def step(self, top_logprobs: list[list[tuple[int, float]]]) -> None:
        """Advance by one token: `top_logprobs[i]` is running beam i's top-K (token id, logprob)."""
        p = self.params
        num_generated = len(self.running[0].token_ids) + 1  # of every candidate
        scored = [
            (beam.score + lp, beam, token, lp) for beam, tops in zip(self.running, top_logprobs) for token, lp in tops
        ]
        candidates = sorted(scored, key=lambda c: -c[0])[: p.num_candidates]
        hits = [token in p.eos_token_ids or num_generated == p.max_new_tokens for _, _, token, _ in candidates]
        for (score, beam, token, lp), _ in filter(lambda ch: ch[1], zip(candidates[: p.num_beams], hits)):
            self.finished.append(beam.then(token, lp, score / num_generated**p.length_penalty))
        self.finished = sorted(self.finished, key=lambda b: -b.score)[: p.num_beams]
        survivors = [c for c, hit in zip(candidates, hits) if not hit][: p.num_beams]
        self.running = [beam.then(token, lp, score) for score, beam, token, lp in survivors]
        is_full = len(self.finished) == p.num_beams
        self.is_done = not self.running or (
            is_full and (p.early_stopping is True or not self._may_improve(num_generated))
        )

    def _may_improve(self, num_generated: int) -> bool:
        """Whether the best running beam may still beat the worst kept hypothesis (transformers' heuristic)."""
        p = self.params
        length = p.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0.0 else num_generated
        return self.running[0].score / length**p.length_penalty > self.finished[-1].score


async def beam_search(engine: EngineClient, prompt_ids: list[int], params: BeamSearchParams) -> list[Beam]:
    """Run the search over the engine: each step's beams go in together, as one batch."""
    search = BeamSearch(params)
    while not search.is_done:
        tops = await asyncio.gather(*(_top_logprobs(engine, prompt_ids + b.token_ids, params) for b in search.running))
        search.step(list(tops))
    return search.finished


async def _top_logprobs(engine: EngineClient, ids: list[int], params: BeamSearchParams) -> list[tuple[int, float]]:
    """The top-K next tokens of `ids` and their logprobs (log-softmax of the raw logits: greedy, no processors)."""
    request = GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_ids=ids,
        sampling=SamplingParams(top_n_tokens=params.num_candidates),
        max_new_tokens=1,
        ignore_eos=True,
    )
    event = await final_event(engine, request)
    return [(t.token_id, t.logprob) for t in event.top_tokens[0]]
