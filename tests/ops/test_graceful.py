"""SIGTERM drains in-flight requests, refuses new ones, runs the caller's cleanup and exits 0."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

APP = os.path.join(os.path.dirname(__file__), "drain_app.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(grace: float, stream_seconds: float):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, APP, str(port), str(grace), str(stream_seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout.readline().strip() == "listening"
    return proc, f"http://127.0.0.1:{port}"


def stream_in_thread(url: str, received: list[str], first_chunk: threading.Event) -> threading.Thread:
    def run():
        try:
            with httpx.stream("GET", url + "/stream", timeout=30) as response:
                for line in response.iter_lines():
                    if line:
                        received.append(line)
                        first_chunk.set()
        except httpx.HTTPError as error:
            received.append(f"error: {type(error).__name__}")
        first_chunk.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sigterm_drains_running_request_and_exits_zero():
    proc, url = start(grace=30, stream_seconds=2.0)
    received, first = [], threading.Event()
    thread = stream_in_thread(url, received, first)
    assert first.wait(10)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):  # the listener is closed: no new requests
        httpx.get(url + "/stream", timeout=2)
    thread.join(30)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert received[-1] == "data: [DONE]" and len(received) == 11  # the running stream finished
    assert "cleanup done after SIGTERM" in output


def test_grace_period_bounds_the_drain():
    proc, url = start(grace=1, stream_seconds=20.0)
    received, first = [], threading.Event()
    thread = stream_in_thread(url, received, first)
    assert first.wait(10)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    thread.join(30)
    assert time.monotonic() - began < 10
    assert proc.returncode == 0
    assert "data: [DONE]" not in received  # cut off at the grace limit
    assert "cleanup done after SIGTERM" in output
