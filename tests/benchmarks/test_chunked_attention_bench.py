"""benchmarks/device/chunked_attention.py's CPU smoke run: its decode and prefill cases (kernels interpreted, tiny
shapes) each match the reference and are timed chunked and global, and the table and the JSON are written."""

from __future__ import annotations

import json

from tests.benchmarks.smoke import smoke_run


def test_chunked_attention_benchmark_smoke_run(tmp_path):
    done = smoke_run("chunked_attention", tmp_path)
    report = json.loads((tmp_path / "chunked_attention.json").read_text())
    assert [case["kind"] for case in report["cases"]] == ["decode", "decode", "prefill"]
    assert all(case["rel_diff"] < 1e-5 and case["chunked_us"] > 0 for case in report["cases"])
    assert "| decode B=1 L=70 |" in done.stdout
