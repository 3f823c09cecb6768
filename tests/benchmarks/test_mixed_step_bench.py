"""benchmarks/device/mixed_step.py's CPU smoke run: a tiny Llama's decode rows give the same logits with a prompt
chunk mixed in, every chunk size is timed mixed and alone, and the table and the JSON are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_mixed_step_benchmark_smoke_run(tmp_path):
    command = [sys.executable, "-m", "benchmarks.device.mixed_step", "--device", "cpu"]
    done = subprocess.run(
        command, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "mixed_step.json").read_text())
    assert report["decode_rows_rel_diff"] < 1e-5
    assert sorted(report["chunks"]) == ["16", "8"]
    assert all(row["mixed_ms"] > 0 and row["prompt_alone_ms"] > 0 for row in report["chunks"].values())
    assert "| prompt tokens mixed in |" in done.stdout
