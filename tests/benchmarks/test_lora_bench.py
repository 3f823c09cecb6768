"""benchmarks/device/lora.py's whole path on the CPU (`--device cpu`: a tiny Llama, 4 streams, the kernels once each
under Triton's interpreter against their references): the GPU run meets no code it never ran."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path


def test_lora_benchmark_smoke_run(tmp_path: Path):
    env = os.environ | {"OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.device.lora", "--device", "cpu", "--work-dir", str(tmp_path / "work")],
        env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_lora.json").read_text())
    assert [k["rows"] for k in report["kernels"]] == [1, 3] and all("step_us" in k for k in report["kernels"])
    values = {row["measure"]: row["value"] for row in report["table"]}
    on = report["lora_on"]
    not_finite = [what for what, value in values.items() if not math.isfinite(value)]
    # a CPU shared with other work may stall the streams through the whole window without a load (on a GPU:
    # hundreds of gaps): no gap there, nothing to compare with
    without_load = {
        "... the same window without the load (ms)",
        "... longest gap, with the load - without (ms)",
        "... p99 gap with the load / without",
    }
    first_window = {"... the same, the engine's first window of that batch size (ms)"}
    expected = (without_load if on["noload_gaps"] == 0 else set()) | (
        first_window if on["first_noload_gaps"] == 0 else set()
    )
    assert len(values) == 15 and set(not_finite) == expected, (not_finite, on)
    assert report["fp8_lora_on"]["spread_tok_s"] > 0
    assert on["spread_tok_s"] > 0 and on["late_ready_s"] > 0 and on["late_first_token_s"] >= on["late_ready_s"]
    # the window without a load is as long as the one with it
    assert on["noload_window_s"] == on["late_window_s"] and on["late_gaps"] > 0 and on["noload_ready_s"] < 0.1
    assert "| batch-1 time per token, adapter / base |" in done.stdout
