"""How many drafts to verify per request this step: as many as raise the step's expected output tokens
per second, given what a step of N token rows costs and each request's acceptance so far.

Verifying k drafts of B requests costs a step of B + sum(k) rows; the j-th draft of a request with
per-token acceptance a is worth a**j expected tokens (all drafts before it must be accepted too). Every
candidate draft is ranked by that worth and drafts are added best first while tokens / step time
grows; where the step time rises faster than the worth (a large batch: compute-bound), no draft is
added and speculation is off. A draft head (EAGLE-3) adds its own time to the step: about one eager forward
of the drafting requests per draft token (`HeadCost`); model-free proposers cost nothing here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCostTable:
    """Seconds of one step against its token rows (measured on the device: the engine's step-time table),
    linear between points and past the last one along the last segment."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rows) < 2 or len(self.rows) != len(self.seconds) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError("a step cost table needs >= 2 points with increasing row counts")

    def cost(self, num_rows: int) -> float:
        rows, seconds = self.rows, self.seconds
        i = min(max(bisect.bisect_left(rows, num_rows), 1), len(rows) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (rows[i] - rows[i - 1])
        return seconds[i - 1] + slope * (num_rows - rows[i - 1])


@dataclass(frozen=True, slots=True)
class HeadCost:
    """Seconds a draft head takes to draft k tokens for B requests: fixed(B) + per_draft(B) * k (the fold of
    the target's hidden states, then one forward per draft), each linear in B between measured batch sizes
    (tgi_compat/modeling/step_cost.py: measure_head_costs)."""

    fixed: StepCostTable
    per_draft: StepCostTable

    def cost(self, num_requests: int, num_drafts: int) -> float:
        if num_requests <= 0 or num_drafts <= 0:
            return 0.0
        fixed, per_draft = self.fixed.cost(num_requests), self.per_draft.cost(num_requests)
        return max(fixed, 0.0) + max(per_draft, 0.0) * num_drafts


def _head_cost(head: HeadCost | None, num_requests: int, num_drafts: int) -> float:
    return 0.0 if head is None else head.cost(num_requests, num_drafts)


PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # what a request is expected to accept before anything was verified


@dataclass(slots=True)
class AcceptanceStats:
    """One request's drafts so far, as a geometric model: each draft token is accepted with probability
    `rate` until the first rejection. A prior rate (the server-wide estimate: estimate.py) over `prior_weight`
    pseudo-tokens stands in for the first steps."""

    accepted: int = 0
    rejected: int = 0  # verify steps that ended at a rejected draft
    prior_weight: float = PRIOR_WEIGHT

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.rejected += num_accepted < num_drafts

    def rate(self, prior_rate: float = PRIOR_RATE) -> float:
        prior = self.prior_weight
        return (self.accepted + prior * prior_rate) / (self.accepted + self.rejected + prior)


def choose_draft_lengths(
    rates: Sequence[float],
    caps: Sequence[int],
    table: StepCostTable,
    other_rows: int = 0,
    other_tokens: int = 0,
    head: HeadCost | None = None,
) -> list[int]:
    """Drafts to verify per request (at most caps[i], the drafts its proposer has) maximizing the step's
    expected tokens per second; all zero when no draft pays for its rows (and the `head`'s time to draft
    them: its drafting requests, its longest draft). `other_rows` / `other_tokens`: the rest of the step
    (prefill chunks, decodes that may not draft) and the tokens it yields."""
    candidates = sorted(
        ((rate**j, i) for i, (rate, cap) in enumerate(zip(rates, caps)) for j in range(1, cap + 1)),
        key=lambda c: -c[0],  # stable: a request's drafts stay in order
    )
    num_rows = len(rates) + other_rows
    tokens = float(len(rates) + other_tokens)
    best_rate, best_count = tokens / table.cost(num_rows), 0
    grown = [0] * len(rates)  # each request's drafts among the candidates so far
    num_drafting = longest = 0
    for count, (worth, i) in enumerate(candidates, start=1):
        num_rows += 1
        tokens += worth
        grown[i] += 1
        num_drafting += grown[i] == 1
        longest = max(longest, grown[i])
        seconds = table.cost(num_rows) + _head_cost(head, num_drafting, longest)
        if (throughput := tokens / seconds) > best_rate:
            best_rate, best_count = throughput, count
    lengths = [0] * len(rates)
    for _, i in candidates[:best_count]:
        lengths[i] += 1
    return lengths


def choose_uniform_draft_length(
    rates: Sequence[float],
    caps: Sequence[int],
    max_length: int,
    table: StepCostTable | None,
    head: HeadCost | None = None,
) -> int:
    """One draft length k for every request of a step the runner replays as a verify graph (each request
    brings k + 1 tokens): a request's drafts past its own caps[i] are padding, worth nothing. Without a
    table, the longest proposal (TGI's fixed N); with one, the k maximizing expected tokens per second,
    0 where no k pays for its B * k extra rows (and the `head`'s time to draft k for B)."""
    longest = min(max(caps, default=0), max_length)
    if table is None:
        return longest
    num_requests = len(rates)
    best_rate, best_length = num_requests / table.cost(num_requests), 0
    for k in range(1, longest + 1):
        tokens = num_requests + sum(rate**j for rate, cap in zip(rates, caps) for j in range(1, min(k, cap) + 1))
        seconds = table.cost(num_requests * (k + 1)) + _head_cost(head, num_requests, k)
        if (throughput := tokens / seconds) > best_rate:
            best_rate, best_length = throughput, k
    return best_length


def drafts_may_pay(
    num_requests: int, max_rate: float, max_length: int, table: StepCostTable, head: HeadCost | None = None
) -> bool:
    """Whether any drafts could raise the tokens per second of a step of `num_requests` decodes whose best
    acceptance rate is `max_rate`: every request drafting the same k (an upper bound on what uniform drafts
    bring), or one request drafting one token (the first step of `choose_draft_lengths`). O(max_length), so
    the engine may ask before each step."""
    base = num_requests / table.cost(num_requests)
    if (num_requests + max_rate) / (table.cost(num_requests + 1) + _head_cost(head, 1, 1)) > base:
        return True
    worth = 1.0
    for k in range(1, max_length + 1):
        worth += max_rate**k
        seconds = table.cost(num_requests * (k + 1)) + _head_cost(head, num_requests, k)
        if num_requests * worth / seconds > base:
            return True
    return False
