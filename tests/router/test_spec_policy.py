"""The draft-length policy (tgi_compat/router/speculative/policy.py): a pure function of rates, caps and step costs."""

from __future__ import annotations

import itertools
import random

import pytest

from tgi_compat.router.speculative.estimate import ServerAcceptance, StepPrior
from tgi_compat.router.speculative.policy import (
    AcceptanceStats,
    HeadCost,
    StepCostTable,
    choose_draft_lengths,
    choose_uniform_draft_length,
    drafts_may_pay,
)

# A memory-bound device: a step's time hardly moves up to 64 rows, then grows with the rows.
MEMORY_BOUND = StepCostTable(rows=(1, 64, 512), seconds=(4.0e-3, 4.6e-3, 30e-3))
COMPUTE_BOUND = StepCostTable(rows=(1, 2), seconds=(1e-3, 2e-3))  # every row costs the same


def test_cost_is_linear_between_points_and_extrapolated():
    assert MEMORY_BOUND.cost(1) == pytest.approx(4.0e-3)
    assert MEMORY_BOUND.cost(64) == pytest.approx(4.6e-3)
    assert MEMORY_BOUND.cost(288) == pytest.approx(4.6e-3 + (30e-3 - 4.6e-3) * 224 / 448)
    assert MEMORY_BOUND.cost(1024) == pytest.approx(30e-3 + (30e-3 - 4.6e-3) * 512 / 448)
    with pytest.raises(ValueError):
        StepCostTable(rows=(4, 2), seconds=(1.0, 2.0))


def test_batch_one_on_a_memory_bound_device_drafts_all_it_has():
    assert choose_draft_lengths([0.7], [4], MEMORY_BOUND) == [4]
    assert choose_draft_lengths([0.7], [0], MEMORY_BOUND) == [0]  # the proposer found nothing


def test_where_each_row_costs_a_full_step_speculation_is_off():
    assert choose_draft_lengths([0.9, 0.5, 0.99], [8, 8, 8], COMPUTE_BOUND) == [0, 0, 0]


def test_large_batches_turn_speculation_off_and_small_ones_on():
    assert choose_draft_lengths([0.6] * 8, [4] * 8, MEMORY_BOUND) == [4] * 8
    assert choose_draft_lengths([0.6] * 256, [4] * 256, MEMORY_BOUND) == [0] * 256


def test_drafts_go_to_the_requests_that_accept_them():
    lengths = choose_draft_lengths([0.9] * 30 + [0.2] * 30, [4] * 60, MEMORY_BOUND)
    assert sum(lengths[:30]) > sum(lengths[30:])
    assert all(a >= b for a, b in zip(lengths[:30], lengths[30:]))


def _throughput(rates, lengths, table):
    tokens = sum(sum(r**j for j in range(k + 1)) for r, k in zip(rates, lengths))
    return tokens / table.cost(len(rates) + sum(lengths))


def test_the_choice_is_the_best_of_every_combination():
    rng = random.Random(0)
    table = StepCostTable(rows=(1, 6, 12), seconds=(1.0, 1.5, 4.0))
    for _ in range(50):
        rates = [rng.random() for _ in range(3)]
        caps = [rng.randrange(5) for _ in range(3)]
        best = max(_throughput(rates, c, table) for c in itertools.product(*(range(cap + 1) for cap in caps)))
        chosen = choose_draft_lengths(rates, caps, table)
        assert all(k <= cap for k, cap in zip(chosen, caps))
        assert _throughput(rates, chosen, table) == pytest.approx(best)


def test_acceptance_rate_starts_at_the_prior_and_follows_the_drafts():
    stats = AcceptanceStats()
    assert stats.rate() == 0.5 and stats.rate(prior_rate=0.1) == pytest.approx(0.1)
    for _ in range(20):
        stats.record(num_drafts=4, num_accepted=4)  # never rejected
    assert stats.rate() > 0.97
    for _ in range(40):
        stats.record(num_drafts=4, num_accepted=0)
    assert stats.rate() == pytest.approx((80 + 1) / (80 + 40 + 2))
    assert stats.rate(prior_rate=0.0) == pytest.approx(80 / (80 + 40 + 2))


def test_the_rest_of_the_step_counts_in_its_cost():
    # 8 drafting decodes alone stay on the flat part of the table; beside 200 decodes that may not draft
    # (penalty rows) the step is compute-bound and a draft's worth no longer pays for its row
    assert choose_draft_lengths([0.6] * 8, [4] * 8, MEMORY_BOUND) == [4] * 8
    assert choose_draft_lengths([0.6] * 8, [4] * 8, MEMORY_BOUND, other_rows=200, other_tokens=200) == [0] * 8
    # beside a long prefill chunk (many rows, no tokens) drafts are almost free: they stay
    assert choose_draft_lengths([0.6] * 8, [4] * 8, MEMORY_BOUND, other_rows=600, other_tokens=0) == [4] * 8


# An H200 running an 8B model, roughly: memory-bound up to a few dozen rows, compute-bound (every row a full
# share of the step) from 64 rows on.
H200_LIKE = StepCostTable(rows=(1, 16, 64, 128, 512), seconds=(4.05e-3, 4.3e-3, 6.2e-3, 12.4e-3, 49.6e-3))


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.95])
def test_a_measured_table_keeps_drafts_at_batch_one_and_drops_them_at_64(rate):
    assert choose_draft_lengths([rate], [4], H200_LIKE) == [4]
    assert choose_draft_lengths([rate] * 64, [4] * 64, H200_LIKE) == [0] * 64
    assert choose_uniform_draft_length([rate], [4], 4, H200_LIKE) == 4
    assert choose_uniform_draft_length([rate] * 64, [4] * 64, 4, H200_LIKE) == 0


def test_one_draft_length_for_a_verify_graph():
    # without a table: the longest proposal, at most the room left
    assert choose_uniform_draft_length([0.5, 0.5], [1, 3], 4, None) == 3
    assert choose_uniform_draft_length([0.5, 0.5], [1, 3], 2, None) == 2
    assert choose_uniform_draft_length([0.5, 0.5], [0, 0], 4, None) == 0
    # padding is worth nothing: one request with drafts among 16 pays for 16 padded rows only when rows are cheap
    flat = StepCostTable(rows=(1, 512), seconds=(1.0, 1.001))
    assert choose_uniform_draft_length([0.9] + [0.5] * 15, [4] + [0] * 15, 4, flat) == 4
    assert choose_uniform_draft_length([0.9] + [0.5] * 15, [4] + [0] * 15, 4, COMPUTE_BOUND) == 0
    # the best k is the best of all of them
    rates, caps = [0.8, 0.4, 0.6], [4, 2, 3]
    for table in (MEMORY_BOUND, H200_LIKE, flat):

        def throughput(k: int, table: StepCostTable = table) -> float:
            tokens = len(rates) + sum(r**j for r, c in zip(rates, caps) for j in range(1, min(k, c) + 1))
            return tokens / table.cost(len(rates) * (k + 1))

        assert choose_uniform_draft_length(rates, caps, 4, table) == max(range(5), key=throughput)


def test_drafts_may_pay_bounds_both_choices():
    assert drafts_may_pay(1, 0.5, 4, H200_LIKE) and drafts_may_pay(16, 0.5, 4, H200_LIKE)
    assert not drafts_may_pay(64, 0.99, 4, H200_LIKE) and not drafts_may_pay(200, 0.99, 4, H200_LIKE)
    assert not drafts_may_pay(1, 0.99, 4, COMPUTE_BOUND)
    rng = random.Random(0)
    tables = (MEMORY_BOUND, H200_LIKE, COMPUTE_BOUND, StepCostTable(rows=(1, 8, 40), seconds=(1.0, 1.2, 3.5)))
    for _ in range(300):
        table, size = rng.choice(tables), rng.randrange(1, 90)
        rates = [rng.random() for _ in range(size)]
        caps = [rng.randrange(0, 5) for _ in range(size)]
        if not drafts_may_pay(size, max(rates), 4, table):  # then neither policy drafts anything
            assert choose_uniform_draft_length(rates, caps, 4, table) == 0
            assert not any(choose_draft_lengths(rates, caps, table))


# An EAGLE-3 head run eagerly: ~0.8 ms per draft forward (kernel launches) at small batches, ~1 ms to fold in
HEAD = HeadCost(
    fixed=StepCostTable(rows=(1, 64), seconds=(1.0e-3, 1.4e-3)),
    per_draft=StepCostTable(rows=(1, 64), seconds=(0.8e-3, 1.1e-3)),
)


def test_the_head_costs_fixed_plus_per_draft_and_nothing_without_drafts():
    assert HEAD.cost(1, 3) == pytest.approx(1.0e-3 + 3 * 0.8e-3)
    assert HEAD.cost(64, 1) == pytest.approx(2.5e-3)
    assert HEAD.cost(8, 0) == HEAD.cost(0, 4) == 0.0


@pytest.mark.parametrize("rate", [0.3, 0.45])
def test_the_heads_cost_turns_drafting_off_where_the_table_alone_drafts(rate):
    # 16 streams on the memory-bound table: verify rows are nearly free, but k head forwards are not
    rates, caps = [rate] * 16, [4] * 16
    assert any(choose_draft_lengths(rates, caps, MEMORY_BOUND))
    assert choose_draft_lengths(rates, caps, MEMORY_BOUND, head=HEAD) == [0] * 16
    assert choose_uniform_draft_length(rates, caps, 4, MEMORY_BOUND) > 0
    assert choose_uniform_draft_length(rates, caps, 4, MEMORY_BOUND, HEAD) == 0
    assert drafts_may_pay(16, rate, 4, MEMORY_BOUND)
    assert not drafts_may_pay(16, rate, 4, MEMORY_BOUND, HEAD)


def test_the_heads_cost_shortens_drafts_and_keeps_good_ones():
    # a high acceptance still pays for the head at batch 1; a weaker one drafts fewer tokens than without it
    assert choose_uniform_draft_length([0.9], [4], 4, MEMORY_BOUND, HEAD) == 4
    assert choose_draft_lengths([0.9], [4], MEMORY_BOUND, head=HEAD) == [4]
    assert choose_uniform_draft_length([0.6] * 4, [4] * 4, 4, MEMORY_BOUND) == 4
    assert choose_uniform_draft_length([0.6] * 4, [4] * 4, 4, MEMORY_BOUND, HEAD) == 2
    assert choose_draft_lengths([0.6] * 4, [4] * 4, MEMORY_BOUND, head=HEAD) == [2] * 4


def test_with_a_head_drafts_may_pay_still_bounds_both_choices():
    rng = random.Random(1)
    for _ in range(300):
        table, size = rng.choice((MEMORY_BOUND, H200_LIKE)), rng.randrange(1, 40)
        rates = [rng.random() for _ in range(size)]
        caps = [rng.randrange(0, 5) for _ in range(size)]
        if not drafts_may_pay(size, max(rates), 4, table, HEAD):
            assert choose_uniform_draft_length(rates, caps, 4, table, HEAD) == 0
            assert not any(choose_draft_lengths(rates, caps, table, head=HEAD))


def _pays_above(threshold: float):
    return lambda rate: rate > threshold


def _steps(estimate: ServerAcceptance, pays, num_steps: int, chunks: int, accepted: int, drafts: int = 4) -> int:
    """`num_steps` steps of `chunks` requests whose verify chunks accept `accepted` of `drafts`, drafting where the
    estimate's step prior says some draft may pay -> how many of them explored."""
    explored = 0
    for _ in range(num_steps):
        step = estimate.step_prior(pays)
        assert estimate.step_prior(pays) == step  # (asked twice in a step: the same answer)
        for _ in range(chunks if step.drafts else 0):
            estimate.record(drafts, accepted)
        explored += step.explores
        estimate.end_step(step)
    return explored


def test_the_server_estimate_starts_at_the_prior_and_follows_recent_drafts():
    estimate = ServerAcceptance()
    assert estimate.rate == 0.5 and estimate.optimistic > 0.9
    _steps(estimate, _pays_above(0.0), 100, chunks=8, accepted=0)
    assert estimate.rate < 0.01 and estimate.optimistic < 0.02  # ~800 rejections: the prior's pseudo-counts fade
    _steps(estimate, _pays_above(0.0), 100, chunks=8, accepted=4)
    assert 0.5 < estimate.rate < 0.9  # the zeros weigh less ...
    _steps(estimate, _pays_above(0.0), 1000, chunks=8, accepted=4)
    assert estimate.rate > 0.99  # ... and are forgotten: the recent window, not the whole history


def test_exploration_is_bounded_and_only_where_the_optimistic_rate_pays():
    estimate = ServerAcceptance()
    assert _steps(estimate, _pays_above(1.0), 500, chunks=8, accepted=0) == 0
    # a rate of 0.4 would pay, none is accepted: the first few steps and then one in `explore_every` at most
    explored = _steps(estimate, _pays_above(0.4), 2000, chunks=8, accepted=0)
    assert estimate.startup_explorations <= explored <= estimate.startup_explorations + 2000 / estimate.explore_every
    assert estimate.rate < 0.05


def test_idle_steps_widen_the_optimistic_rate_so_a_returning_acceptance_is_found():
    estimate = ServerAcceptance()
    _steps(estimate, _pays_above(0.0), 50, chunks=16, accepted=0)
    pays_at = _pays_above(0.3)
    assert not estimate.step_prior(pays_at).drafts  # no draft accepted lately: even the optimistic rate fails
    for _ in range(2000):  # steps with no drafts: the evidence ages
        estimate.end_step(estimate.step_prior(pays_at))
    assert estimate.rate < 0.05 and estimate.optimistic > 0.3
    # the acceptance is back (4 of 4): an exploration finds it, and then the estimate itself pays
    _steps(estimate, pays_at, 200, chunks=16, accepted=4)
    assert estimate.rate > 0.9 and estimate.step_prior(pays_at) == StepPrior(estimate.rate, drafts=True)


def test_a_costly_head_is_tried_from_the_start():
    estimate = ServerAcceptance()  # 0.5 does not pay, 0.9 does: the startup explorations draft, then the rate pays
    pays_at = _pays_above(0.8)
    assert estimate.step_prior(pays_at).explores
    _steps(estimate, pays_at, 20, chunks=4, accepted=4)
    step = estimate.step_prior(pays_at)
    assert step.drafts and not step.explores and estimate.rate > 0.9
