"""Metric math on hand-made timestamps: TTFT, TPOT, pooled ITL, percentiles, throughput."""

import math

import numpy as np
import pytest

from benchmarks.metrics import RequestRecord, distribution, summarize, throughput_timeline
from benchmarks.runner import arrival_offsets


def make_record(
    send: float, chunks: list[float], tokens: int | None = None, max_new: int = 10, prompt_len: int = 5
) -> RequestRecord:
    return RequestRecord(
        prompt_len=prompt_len,
        max_new_tokens=max_new,
        send_time=send,
        chunk_times=chunks,
        end_time=chunks[-1],
        output_tokens=len(chunks) if tokens is None else tokens,
    )


def test_ttft_e2e_tpot_of_one_request():
    record = make_record(1.0, [1.5, 1.6, 1.8, 2.1])
    assert record.ttft == pytest.approx(0.5)
    assert record.e2e == pytest.approx(1.1)
    # (E2E - TTFT) / (tokens - 1) = 0.6 / 3
    assert record.tpot == pytest.approx(0.2)
    assert record.itls == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_counts_tokens_not_chunks():
    # Two chunks carrying 5 tokens (an OpenAI server batching its stream): TPOT divides by 4.
    record = make_record(0.0, [0.1, 0.9], tokens=5)
    assert record.tpot == pytest.approx(0.8 / 4)


def test_single_token_request_has_no_tpot():
    assert make_record(0.0, [0.3]).tpot is None


def test_distribution_percentiles_in_ms():
    d = distribution([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["count"] == 100
    assert d["mean_ms"] == pytest.approx(50.5)
    assert d["median_ms"] == pytest.approx(50.5)
    assert d["p90_ms"] == pytest.approx(90.1)
    assert d["p99_ms"] == pytest.approx(99.01)
    assert d["max_ms"] == pytest.approx(100)
    assert d["median_ms"] <= d["p90_ms"] <= d["p99_ms"] <= d["max_ms"]


def test_empty_distribution():
    assert distribution([]) == {"count": 0}


def test_summary_pools_itl_over_requests_and_divides_by_duration():
    a = make_record(0.0, [0.2, 0.3, 0.4], max_new=3, prompt_len=7)  # gaps 0.1, 0.1
    b = make_record(0.5, [1.0, 1.5], max_new=4, prompt_len=3)  # gap 0.5; ended early (2 < 4)
    failed = RequestRecord(prompt_len=9, max_new_tokens=4, error="HTTP 500")
    s = summarize([a, b, failed], duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["total_input_tokens"] == 10 and s["total_output_tokens"] == 5
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx(7.5)
    assert s["ended_early"] == 1
    assert s["itl"]["count"] == 3  # pooled: 2 gaps from a, 1 from b
    assert s["itl"]["mean_ms"] == pytest.approx((100 + 100 + 500) / 3)
    assert s["itl"]["max_ms"] == pytest.approx(500)
    # TPOT is per request, then averaged: a = 0.2/2, b = 0.5/1
    assert s["tpot"]["mean_ms"] == pytest.approx((100 + 500) / 2)
    assert s["ttft"]["mean_ms"] == pytest.approx((200 + 500) / 2)
    assert s["mean_concurrency"] == pytest.approx((0.4 + 1.0) / 2.0)


def test_throughput_timeline_bins_tokens():
    a = make_record(0.0, [0.1, 0.2, 1.1])
    t = throughput_timeline([a], start=0.0, bin_s=1.0)
    assert t["output_tokens_per_s"] == pytest.approx([2.0, 1.0])
    assert sum(t["output_tokens_per_s"]) * t["bin_s"] == pytest.approx(a.output_tokens)


def test_poisson_arrivals_have_the_requested_rate():
    offsets = arrival_offsets(20_000, rate=8.0, burstiness=1.0, seed=1)
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 8, rel=0.05)  # exponential: std = mean


def test_burstiness_changes_spread_not_rate():
    gaps = np.diff(arrival_offsets(20_000, rate=8.0, burstiness=0.25, seed=1))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.05)
    assert gaps.std() == pytest.approx((1 / 8) / math.sqrt(0.25), rel=0.08)  # gamma CV = 1/sqrt(k)


def test_infinite_rate_sends_everything_at_once():
    assert not arrival_offsets(5, math.inf).any()
