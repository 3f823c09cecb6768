"""benchmarks/device/diverse.py's CPU smoke run: its tokens-match check, its kernel cases (interpreted) and both
engine processes (a tiny dummy-weight Llama, Triton backend interpreted) run end to end and write the table and the
JSON."""

from __future__ import annotations

import json

from tests.benchmarks.smoke import smoke_run


def test_diverse_benchmark_smoke_run(tmp_path):
    # one form of the shared-prefix kernel in the engines (test_diverse_mode_engine.py serves the other)
    args = ["--groups", "1", "--engine-groups", "1", "--new-tokens", "3", "--work-dir", str(tmp_path)]
    done = smoke_run("diverse", tmp_path / "out", *args, timeout=500)
    report = json.loads((tmp_path / "out" / "diverse.json").read_text())
    check = report["check"]  # diverse off vs on in-process: same tokens, the 8 siblings grouped
    assert check["identical"] == check["requests"] == 11 and check["largest_group"] == 8, check
    kernel = report["kernels"][0]  # both forms of the shared-prefix kernel agree with flash-decoding
    assert kernel["rows"] == 8 and kernel["rel_diff"] < 1e-5 and kernel["other_form_rel_diff"] < 1e-5
    # off, then on (the kernel's form as the engine process chooses it: no TGI_COMPAT_GROUP_SUFFIX)
    assert [(e["diverse"], e["group_suffix"]) for e in report["engines"]] == [(False, None), (True, None)]
    assert all(e["tokens"] == 8 * 3 for e in report["engines"])  # n = 8 siblings, 3 tokens each
    for engine in report["engines"][1:]:  # the engine's own count: every row of its decode steps grouped
        grouping = engine["grouping"]
        assert grouping["steps"] >= 1 and grouping["grouped_rows_per_step"] == grouping["rows_per_step"] > 1, grouping
    assert "decode phase" in report["table"] and "| engine, 8 rows (1 x n=8), decode phase" in done.stdout
