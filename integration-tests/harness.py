"""What integration tests share besides fixtures: starting and waiting for a real launcher.

Tests import these from `harness` (a plain `from conftest import ...` can resolve to another test
directory's conftest when `pytest tests integration-tests` runs in one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.background import Background

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 900
# A chat-formatted prompt: the instruct model answers it ("The capital of France is Paris.").
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
MAX_TOTAL_TOKENS = 512
MAX_CONCURRENT_REQUESTS = 6


@dataclass(frozen=True)
class Server:
    base_url: str
    process: subprocess.Popen
    log_path: str

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-chars:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launcher_command(port: int) -> list[str]:
    script = Path(sys.executable).parent / "text-generation-launcher"  # this venv's, not always .venv's
    program = [str(script)] if script.exists() else [sys.executable, "-m", "tgi_compat.api.cli.launcher"]
    return [
        *program,
        "--hostname", "127.0.0.1",
        "--port", str(port),
        "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        "--max-concurrent-requests", str(MAX_CONCURRENT_REQUESTS),
        "--enable-prefill-logprobs",
    ]  # fmt: skip


def _wait_until_ready(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"launcher exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # connection refused until the engine is warm, as with TGI
        time.sleep(0.2)  # a refused connection costs nothing: the tests start as soon as the port opens
    pytest.fail(f"launcher not ready after {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


@contextlib.contextmanager
def launched(command: list[str], env: dict[str, str], log_prefix: str, stop_timeout_s: float = 60) -> Iterator[Server]:
    """Start a server process, wait until /health answers, and stop it (SIGTERM, then SIGKILL) at the end."""
    log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)
    # this checkout's tgi_compat, not the one the venv's console script was installed from
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    handle = Server(f"http://127.0.0.1:{_port_of(command)}", process, log.name)
    try:
        _wait_until_ready(handle)
        yield handle
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


def _port_of(command: list[str]) -> str:
    return command[command.index("--port") + 1]


def child_processes(server: Server) -> dict[int, bytes]:
    """The launcher's direct children: pid -> command line (its arguments joined by spaces)."""
    children = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.process.pid:
            children[int(proc.name)] = cmdline
    return children


def metric(url: str, name: str) -> float:
    """A series of /metrics (the first of that name; NaN when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


async def _statuses_at_once(url: str, count: int) -> list[int]:
    # 4 tokens: each request holds its permit through a prefill and decode steps, far longer than the sends' spread
    body = {"inputs": "Count to ten: 1, 2,", "parameters": {"max_new_tokens": 4}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(count)))
    return [response.status_code for response in responses]


def assert_sound(url: str, permits: int = MAX_CONCURRENT_REQUESTS) -> None:
    """What a hostile request must leave behind: /health answers 200, all `permits` are free (that many
    requests at once, none refused with 429), and the engine goes idle with its KV cache empty."""
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert asyncio.run(_statuses_at_once(url, permits)) == [200] * permits
    idle = ("tgi_batch_current_size", "tgi_queue_size", "vllm:kv_cache_usage_perc")
    deadline = time.monotonic() + 15
    while (gauges := {name: metric(url, name) for name in idle}) != dict.fromkeys(idle, 0.0):
        assert time.monotonic() < deadline, f"the engine is not idle: {gauges}"
        time.sleep(0.1)


class Sampling(Background):
    """`sample()` in a daemon thread while the with-block runs: at once, then every `every_s` seconds."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s
        self._stop = threading.Event()

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.every_s):
            self.sample()

    def _halt(self) -> None:
        self._stop.set()
