"""A device benchmark's CPU smoke run as the tests make it: `python -m benchmarks.device.NAME --device cpu ...` in a
subprocess (the module may set TRITON_INTERPRET before Triton loads) writing under its own $OUT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def smoke_run(module: str, out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", f"benchmarks.device.{module}", "--device", "cpu", *args]
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
