"""Integration fixtures: ONE real `text-generation-launcher` process for the whole session
(embedded SmolLM2, engine subprocess, real port), driven by real clients and raw HTTP.

Like TGI's integration suite: the launcher is started with flags, readiness is "the port answers
/health with 200" (before that the port refuses connections), and whole greedy responses are
compared with stored syrupy snapshots with a relative tolerance on logprobs.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from syrupy.extensions.json import JSONSnapshotExtension

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
    script = REPO_ROOT / ".venv" / "bin" / "text-generation-launcher"
    program = [str(script)] if script.exists() else [sys.executable, "-m", "tgi_compat.launcher"]
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
        time.sleep(1)
    pytest.fail(f"launcher not ready after {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def server():
    if os.environ.get("TGI_COMPAT_SERVER_URL"):
        # A server someone already started with `_launcher_command`'s flags (for quick iteration).
        yield Server(os.environ["TGI_COMPAT_SERVER_URL"], None, os.devnull)  # type: ignore[arg-type]
        return
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="launcher-", suffix=".log", delete=False)
    env = {**os.environ, "LOG_LEVEL": "info"}
    process = subprocess.Popen(_launcher_command(port), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    handle = Server(f"http://127.0.0.1:{port}", process, log.name)
    try:
        _wait_until_ready(handle)
        yield handle
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url


@pytest.fixture
async def http(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        yield client


# ----------------------------------------------------------------------------------- snapshots


def _close(expected, actual, rtol: float) -> bool:
    """Equal JSON, floats within `rtol` (TGI's response_snapshot uses rtol=0.2 on logprobs)."""
    if isinstance(expected, float) or isinstance(actual, float):
        if expected is None or actual is None:
            return expected is actual
        return math.isclose(expected, actual, rel_tol=rtol, abs_tol=1e-3)
    if isinstance(expected, dict) and isinstance(actual, dict):
        return expected.keys() == actual.keys() and all(_close(expected[k], actual[k], rtol) for k in expected)
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(_close(e, a, rtol) for e, a in zip(expected, actual))
    return expected == actual


class ToleranceSnapshotExtension(JSONSnapshotExtension):
    rtol = 0.2

    def matches(self, *, serialized_data, snapshot_data) -> bool:
        try:
            return _close(json.loads(snapshot_data), json.loads(serialized_data), self.rtol)
        except (TypeError, ValueError):
            return False


@pytest.fixture
def response_snapshot(snapshot):
    return snapshot.use_extension(ToleranceSnapshotExtension)
