"""Start a server command in its own process group, wait for /health, and stop it again."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmarks.cli_common import wait_for_health


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(
    command: str, base_url: str, startup_timeout_s: float, log_path: Path | None = None
) -> Iterator[subprocess.Popen]:
    """Run ``command`` (e.g. 'text-generation-launcher --model-id X --port 3000') for the with-block."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # A SIGTERM to us (e.g. from `timeout`) must still stop the server we started in its own session.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        wait_for_health_or_exit(proc, base_url, startup_timeout_s)
        yield proc
    finally:
        stop(proc)
        signal.signal(signal.SIGTERM, previous)
        if log_path:
            log.close()


def wait_for_health_or_exit(proc: subprocess.Popen, base_url: str, timeout_s: float) -> None:
    try:
        wait_for_health(base_url, timeout_s, is_alive=lambda: proc.poll() is None)
    except TimeoutError:
        raise RuntimeError(f"server did not become healthy (exit code {proc.poll()})") from None


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (it may have engine children), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
