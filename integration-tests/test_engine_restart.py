"""LightLLM's --health_monitor on the real launcher: the engine process is killed, in-flight work fails
with TGI's error shape, and the monitor brings a fresh engine up that serves again. Without the flag
the server stops instead (TGI's behaviour), so this module starts its own launcher."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from harness import CHAT_PROMPT, Server, _free_port, _launcher_command, child_processes, launched

BODY = {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": 4}}


@pytest.fixture(scope="module")
def monitored_server():
    command = _launcher_command(_free_port()) + ["--health-monitor"]
    with launched(command, {**os.environ}, "launcher-monitor-") as handle:
        yield handle


def engine_pids(server: Server) -> list[int]:
    """The launcher's multiprocessing children that run the engine (not the resource tracker)."""
    return [
        pid
        for pid, cmdline in child_processes(server).items()
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline
    ]


def test_a_killed_engine_is_restarted_and_serves_again(monitored_server):
    url = monitored_server.base_url
    assert httpx.post(f"{url}/generate", json=BODY, timeout=120).status_code == 200
    [engine] = engine_pids(monitored_server)
    long_stream = {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": 400}}
    with httpx.stream("POST", f"{url}/generate_stream", json=long_stream, timeout=120) as stream:
        events = stream.iter_lines()
        first = next(line for line in events if line.startswith("data:"))
        assert '"token"' in first
        os.kill(engine, signal.SIGKILL)  # mid-generation
        last = [line for line in events if line.startswith("data:")][-1]
    # the in-flight request ends with TGI's error event, not a hang
    assert '"error_type":"generation"' in last, last

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert monitored_server.process.poll() is None, monitored_server.log_tail()  # the server stays up
        replacement = [pid for pid in engine_pids(monitored_server) if pid != engine]
        if replacement and httpx.get(f"{url}/health", timeout=30).status_code == 200:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no healthy engine after the kill:\n{monitored_server.log_tail()}")

    response = httpx.post(f"{url}/generate", json=BODY, timeout=120)
    assert response.status_code == 200 and response.json()["generated_text"]
    assert "restart" in monitored_server.log_tail(20000).lower()
