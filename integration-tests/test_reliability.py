"""Never down, on the real launcher: a busy server answers /health, drops work its clients abandon,
comes back to its idle memory after a burst, and stops cleanly on SIGTERM whatever is in flight.

One launcher for the module (the flags of the soak test: benchmarks/soak); the SIGTERM test runs
last and stops it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest
from harness import Sampling, _free_port, launched

GRACE_S = 5  # short: the 50 requests outlast it, so the test sees the grace run out
HEALTH_DEADLINE_S = 2.0  # /health must answer within this (1 s in the soak; CI runners are noisier)

# Greedy SmolLM2 keeps counting to the length cap ("Tell me a long story." ends at once with EOS),
# so these requests are still running when the test needs them to be.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"


def _command(port: int) -> list[str]:
    import sys

    return [
        sys.executable, "-m", "tgi_compat.api.cli.launcher",
        "--hostname", "127.0.0.1",
        "--port", str(port),
        "--max-concurrent-requests", "256",
        "--max-total-tokens", "512",
        "--max-input-tokens", "256",
        "--graceful-termination-timeout", str(GRACE_S),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def busy_server():
    with launched(_command(_free_port()), {**os.environ}, "launcher-reliability-") as handle:
        yield handle


def batch_size(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return float(re.search(r"^tgi_batch_current_size (\S+)$", text, re.M).group(1))


class HealthPoller(Sampling):
    """Polls /health in a thread; records every answer's status and latency."""

    def __init__(self, url: str, every_s: float = 0.25) -> None:
        super().__init__(every_s)
        self.url = url
        self.answers: list[tuple[int | str, float]] = []
        self._client = httpx.Client(timeout=HEALTH_DEADLINE_S)

    def sample(self) -> None:
        started = time.perf_counter()
        try:
            status: int | str = self._client.get(f"{self.url}/health").status_code
        except httpx.HTTPError as error:
            status = type(error).__name__
        self.answers.append((status, time.perf_counter() - started))

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._client.close()

    def assert_always_healthy(self) -> None:
        assert self.answers, "no /health answer at all"
        bad = [(status, round(seconds, 2)) for status, seconds in self.answers if status != 200]
        assert not bad, f"{len(bad)} of {len(self.answers)} /health polls failed: {bad[:10]}"


def test_top_n_tokens_with_top_k_1_reports_only_finite_alternatives(busy_server):
    """The spec's own example: fewer survivors than top_n_tokens; -inf is never a tie (nor JSON)."""
    body = {"inputs": "Hello", "parameters": {"top_k": 1, "top_n_tokens": 2, "max_new_tokens": 5, "details": True}}
    response = httpx.post(f"{busy_server.base_url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert "Infinity" not in response.text
    top_tokens = response.json()["details"]["top_tokens"]
    assert len(top_tokens) == 5 and all(1 <= len(alternatives) <= 2 for alternatives in top_tokens)
    assert all(math.isfinite(token["logprob"]) for alternatives in top_tokens for token in alternatives)


def test_a_deeply_nested_body_is_a_400_like_serde(busy_server):
    deep = b"[" * 100_000 + b"]" * 100_000
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{busy_server.base_url}/generate", content=deep, headers=headers, timeout=30)
    assert response.status_code == 400
    assert response.text == "Failed to parse the request body as JSON: recursion limit exceeded at line 1 column 128"


def test_health_answers_while_a_long_generation_runs(busy_server):
    url = busy_server.base_url
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 200}}
    with HealthPoller(url) as poller:
        response = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    poller.assert_always_healthy()
    assert len(poller.answers) >= 3
    assert busy_server.process.poll() is None


def test_an_abandoned_non_streaming_request_leaves_the_batch_within_a_second(busy_server):
    url = busy_server.base_url
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 400}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=body, timeout=httpx.Timeout(60, read=1.5))
    time.sleep(1.0)
    assert batch_size(url) == 0
    assert "Exception in ASGI application" not in busy_server.log_tail(20_000)


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def _server_pids(busy_server) -> list[int]:
    launcher = psutil.Process(busy_server.process.pid)
    engines = [p for p in launcher.children() if "resource_tracker" not in " ".join(p.cmdline())]
    return [launcher.pid, *(p.pid for p in engines)]


async def _stream_burst(url: str, count: int, max_new_tokens: int = 16) -> list[int]:
    """`count` concurrent /generate_stream calls; the number of tokens each received."""
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": max_new_tokens}}
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one() -> int:
            tokens = 0
            async with client.stream("POST", "/generate_stream", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        event = json.loads(line[5:])
                        assert "error" not in event, event
                        tokens += 1
            return tokens

        return await asyncio.gather(*(one() for _ in range(count)))


def test_a_burst_of_200_streams_completes_and_memory_comes_back(busy_server):
    url = busy_server.base_url
    pids = _server_pids(busy_server)
    assert len(pids) == 2, pids
    asyncio.run(_stream_burst(url, 20))  # allocator pools and caches reach their working size
    before = [_rss(pid) for pid in pids]
    with HealthPoller(url, every_s=0.5) as poller:
        counts = asyncio.run(_stream_burst(url, 200))
    assert counts == [16] * 200
    poller.assert_always_healthy()
    time.sleep(1.0)
    assert batch_size(url) == 0
    after = [_rss(pid) for pid in pids]
    for pid, old, new in zip(pids, before, after):
        assert new <= old * 1.10, f"pid {pid}: RSS {old / 2**20:.0f} MiB -> {new / 2**20:.0f} MiB"


def test_sigterm_with_50_requests_in_flight_exits_0_within_the_grace_period(busy_server):
    """Runs last: stops the module's server."""
    url, process = busy_server.base_url, busy_server.process
    pids = _server_pids(busy_server)
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 200}}
    statuses: list[int | str] = []

    def post() -> None:
        try:
            statuses.append(httpx.post(f"{url}/generate", json=body, timeout=120).status_code)
        except httpx.HTTPError as error:
            statuses.append(type(error).__name__)

    threads = [threading.Thread(target=post) for _ in range(50)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while batch_size(url) < 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert batch_size(url) > 0, "the requests never reached the engine"
    stopped = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=GRACE_S + 10) == 0, busy_server.log_tail()
    elapsed = time.monotonic() - stopped
    for thread in threads:
        thread.join(timeout=30)
    assert elapsed < GRACE_S + 8, f"exited {elapsed:.1f} s after SIGTERM"
    assert len(statuses) == 50
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
