"""can_admit: LightLLM's future-memory estimate, table-driven."""

from __future__ import annotations

import pytest

from tgi_compat.router.admission import AdmissionLimits, RequestTokens, can_admit

R = RequestTokens


def limits(slots=100, max_running=8, ratio=0.0, estimate=1024):
    return AdmissionLimits(
        num_kv_slots=slots,
        max_running_requests=max_running,
        router_token_ratio=ratio,
        router_max_new_token_len=estimate,
    )


CASES = [
    # (name, running, candidate, limits, used, budget, expected)
    # alone: a = 10 + 1, b = 20 - 1 -> peak 30
    ("alone fits", [], R(10, 0, 20), limits(slots=31), 0, 100, True),
    ("alone exactly at the pool is refused (strict <)", [], R(10, 0, 20), limits(slots=30), 0, 100, False),
    # running (a=15, b=4) and candidate (a=11, b=19): sorted b desc -> [(11,19), (15,4)]
    # peaks: 11 + 19 = 30, 26 + 2*4 = 34 -> 34
    ("two requests peak at the second finish", [R(10, 5, 10)], R(10, 0, 20), limits(slots=35), 35, 100, True),
    ("two requests over the pool", [R(10, 5, 10)], R(10, 0, 20), limits(slots=34), 34, 100, False),
    # three equal requests a=11, b=9: peak = 33 + 3*9 = 60
    ("three equal requests", [R(10, 0, 10), R(10, 0, 10)], R(10, 0, 10), limits(slots=61), 0, 100, True),
    (
        "three equal requests, one slot short",
        [R(10, 0, 10), R(10, 0, 10)],
        R(10, 0, 10),
        limits(slots=60),
        0,
        100,
        False,
    ),
    # ignore_eos keeps the worst case even when not busy
    ("optimistic estimate when not busy", [], R(10, 0, 1000), limits(slots=40, ratio=0.5, estimate=20), 0, 100, True),
    (
        "worst case when busy (used/total >= ratio)",
        [],
        R(10, 0, 1000),
        limits(slots=40, ratio=0.5, estimate=20),
        20,
        100,
        False,
    ),
    (
        "ignore_eos is always the worst case",
        [],
        R(10, 0, 1000, True),
        limits(slots=40, ratio=0.5, estimate=20),
        0,
        100,
        False,
    ),
    # optimistic b grows with 1.1 * generated: generated 30 -> est max(33, 20) = 33 -> b = 2, a = 40
    (
        "optimistic estimate grows with the output",
        [R(10, 30, 1000)],
        R(5, 0, 10),
        limits(slots=56, ratio=0.9, estimate=20),
        0,
        100,
        True,
    ),
    ("running-request cap", [R(1, 1, 2)] * 2, R(1, 0, 2), limits(max_running=2), 0, 100, False),
    ("no prefill budget left", [], R(10, 0, 20), limits(slots=1000), 0, 0, False),
    ("a long prompt starts with any budget left (it is chunked)", [], R(500, 0, 20), limits(slots=1000), 0, 1, True),
]


@pytest.mark.parametrize("name,running,candidate,lim,used,budget,expected", CASES, ids=[c[0] for c in CASES])
def test_can_admit(name, running, candidate, lim, used, budget, expected):
    assert can_admit(running, candidate, lim, used, budget) is expected
