"""benchmarks/device/mixed_step.py's CPU smoke run: a tiny Llama's decode rows give the same logits with a prompt
chunk mixed in, every chunk size is timed mixed and alone, and the table and the JSON are written."""

from __future__ import annotations

import json

from tests.benchmarks.smoke import smoke_run


def test_mixed_step_benchmark_smoke_run(tmp_path):
    done = smoke_run("mixed_step", tmp_path)
    report = json.loads((tmp_path / "mixed_step.json").read_text())
    assert report["decode_rows_rel_diff"] < 1e-5
    assert sorted(report["chunks"]) == ["16", "8"]
    assert all(row["mixed_ms"] > 0 and row["prompt_alone_ms"] > 0 for row in report["chunks"].values())
    assert "| prompt tokens mixed in |" in done.stdout
