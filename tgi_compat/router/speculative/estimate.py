"""The server-wide acceptance estimate: what a request that has not drafted yet is expected to accept, and when to
draft anyway to find out.

Each request's own acceptance (policy.AcceptanceStats) starts from a prior. A fixed prior (0.5) made two things go
wrong: with no draft accepted server-wide, every newcomer still looked worth drafting (and turned overlap
scheduling off) until its own rejections piled up; and where a costly draft head does not pay at 0.5, no request
ever drafted, so a true rate of 0.9 was never seen. Here the prior is the acceptance of the speculator's recent
drafts (one speculator serves one method: this is that method's), as a geometric model like a request's:

  accepted / (accepted + rejected): draft tokens accepted, and verify chunks that ended at a rejected draft,
  both decayed by (1 - 1 / window) per step (drafting or not), starting from the fixed prior's pseudo-counts.

Under zero acceptance it falls towards 0 (as rejections pile up and the prior's pseudo-counts fade), so newcomers
start from ~0: they draft nothing where a draft's rows cost more than ~0 tokens bring (all but the smallest
batches), and `drafts_may_pay` keeps overlap scheduling on for them. Exploration keeps that reversible and lets a
costly head be tried: a step drafts under the optimistic rate (the mean plus two standard deviations of
Beta(accepted + 1, rejected + 1)) on the first `startup_explorations` steps where only that rate would pay, then on
one such step in `explore_every` (counted in steps, not tokens: an exploring step of a uniform batch may still
draft nothing). Decay between drafting steps widens the optimistic rate again, so a workload whose acceptance
comes back gets tried again; where even the optimistic rate cannot pay (a large batch), no step explores.
vLLM and SGLang draft on every step; `explore_every = 1` comes closest to that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tgi_compat.router.speculative.policy import PRIOR_RATE, PRIOR_WEIGHT


@dataclass(frozen=True, slots=True)
class StepPrior:
    """The prior of every request's own acceptance in one step, and whether any draft may pay under it."""

    rate: float
    drafts: bool  # some draft may pay: False turns drafting (and its overlap penalty) off for the step
    explores: bool = False  # `rate` is the optimistic one: this step is an exploration
    waits: bool = False  # only the optimistic rate would pay, and no exploration is due


@dataclass(slots=True)
class ServerAcceptance:
    """The speculator's recent acceptance (decayed counts, from the prior's pseudo-counts) and its exploration."""

    window: float = 256.0  # steps over which the counts decay by 1/e
    startup_explorations: int = 8  # the first steps where only the optimistic rate pays: all explore
    explore_every: int = 32  # then: one step in this many of those
    accepted: float = PRIOR_RATE * PRIOR_WEIGHT
    rejected: float = (1 - PRIOR_RATE) * PRIOR_WEIGHT
    num_explored: int = 0  # exploring steps since startup
    waited: int = 0  # steps since the last exploration where only the optimistic rate would pay

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verify chunk: `num_accepted` of its `num_drafts` proposed drafts accepted."""
        self.accepted += num_accepted
        self.rejected += num_accepted < num_drafts

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def optimistic(self) -> float:
        a, b = self.accepted + 1, self.rejected + 1
        mean = a / (a + b)
        return min(1.0, mean + 2 * math.sqrt(a * b / (a + b + 1)) / (a + b))

    def step_prior(self, pays: Callable[[float], bool]) -> StepPrior:
        """This step's prior, given `pays(prior)`: whether any draft may pay where requests start from it. Pure
        (the engine asks, then the scheduler): only `record` and `end_step` move it."""
        if pays(rate := self.rate):
            return StepPrior(rate, drafts=True)
        optimistic = self.optimistic
        if optimistic <= rate or not pays(optimistic):
            return StepPrior(rate, drafts=False)
        due = self.num_explored < self.startup_explorations or self.waited + 1 >= self.explore_every
        return StepPrior(optimistic, drafts=True, explores=True) if due else StepPrior(rate, False, waits=True)

    def end_step(self, step: StepPrior) -> None:
        """Once per step, after its prior was chosen: count it towards the next exploration, and decay the counts
        (never below the prior's weight in all: long idle, they keep their ratio and widen the optimistic rate)."""
        if step.explores:
            self.num_explored, self.waited = self.num_explored + 1, 0
        elif step.waits:
            self.waited += 1
        total = self.accepted + self.rejected
        if total > PRIOR_WEIGHT:
            scale = max(1 - 1 / self.window, PRIOR_WEIGHT / total)
            self.accepted, self.rejected = self.accepted * scale, self.rejected * scale
