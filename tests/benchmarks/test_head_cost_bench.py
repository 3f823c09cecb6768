"""benchmarks/device/head_cost.py's CPU smoke mode: a tiny random EAGLE-3 head, its drafting time measured as the
engine measures it at startup, a table and JSON (the GPU run is the lead's)."""

from __future__ import annotations

import json

from benchmarks.device.head_cost import main
from tgi_compat.modeling.step_cost import HEAD_COST_BATCHES_CPU


def test_the_cpu_smoke_run_measures_every_batch(tmp_path, capsys):
    out = tmp_path / "head_cost.json"
    report = main(["--device", "cpu", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert [row["batch"] for row in report["rows"]] == list(HEAD_COST_BATCHES_CPU)
    assert all(row["drafting_s"] > row["fold_s"] > 0 and row["per_draft_s"] > 0 for row in report["rows"])
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert "| batch | fold ms | per draft ms | k=4 ms |" in capsys.readouterr().out
