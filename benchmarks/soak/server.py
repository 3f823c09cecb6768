"""The soak's server side: a launched server, its /health polled throughout, its state afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.server_process import free_port, running_server

HEALTH_EVERY_S = 2.0
HEALTH_DEADLINE_S = 1.0


@contextlib.contextmanager
def launched(flags: list[str], log_path: str) -> Iterator[tuple[str, object]]:
    """The launcher with `flags` on a free port, healthy, for the with-block: (its URL, its process)."""
    port = free_port()
    command = [sys.executable, "-m", "tgi_compat.api.cli.launcher", "--hostname", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running_server(shlex.join([*command, *flags]), url, 900, Path(log_path)) as process:
        yield url, process


class HealthPoller(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.polls = 0
        self.failures: list[tuple[float, str]] = []  # (seconds into the run, what went wrong)
        self.slowest = 0.0
        self._halt = threading.Event()
        self._began = time.monotonic()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._halt.wait(HEALTH_EVERY_S):
                began = time.monotonic()
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                took = time.monotonic() - began
                self.polls += 1
                self.slowest = max(self.slowest, took)
                if status != 200 or took > HEALTH_DEADLINE_S:
                    self.failures.append((round(began - self._began, 1), f"{status} in {took:.2f} s"))

    def stop(self) -> None:
        self._halt.set()
        self.join()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def idle_and_serving(url: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and metric(url, "tgi_batch_current_size") > 0:
        time.sleep(1)
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 8}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    time.sleep(1.5)  # the engine's idle stats report
    return {
        "generate_status": response.status_code,
        "batch_size": metric(url, "tgi_batch_current_size"),
        "queue_size": metric(url, "tgi_queue_size"),
        "kv_cache_usage": metric(url, "vllm:kv_cache_usage_perc"),
    }


async def stream_burst(url: str, count: int, max_new_tokens: int = 32) -> list[int]:
    """`count` concurrent /generate_stream calls; the token events each received."""
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": max_new_tokens}}
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        return await asyncio.gather(*(_stream_tokens(client, body) for _ in range(count)))


async def _stream_tokens(client: httpx.AsyncClient, body: dict) -> int:
    async with client.stream("POST", "/generate_stream", json=body) as response:
        return sum([line.startswith("data:") and '"error"' not in line async for line in response.aiter_lines()])


def rss_mib(pid: int) -> float:
    import psutil

    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children()]) / 2**20
