"""benchmarks/device/lora_step.py's CPU smoke run: a tiny Llama with 8 adapters in its 8 slots, eager decode steps of
1 and 8 rows timed base, on the LoRA path with no LoRA row, all on one slot and spread over the 8, the table and the
JSON written; then the shrink and expand at every tiling of the sweep, under Triton's interpreter, against their
references."""

from __future__ import annotations

import json

from tests.benchmarks.smoke import smoke_run


def test_lora_step_benchmark_smoke_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    done = smoke_run("lora_step", tmp_path)
    report = json.loads((tmp_path / "lora_step.json").read_text())
    assert sorted(report["steps"], key=int) == ["1", "8"]
    assert all(sorted(steps) == ["base", "no_rows", "one", "spread"] for steps in report["steps"].values())
    assert all(ms > 0 for steps in report["steps"].values() for ms in steps.values())
    assert report["checks"]["spread_vs_base_rel_diff"] > 1e-3  # the adapters change the logits
    assert "| rows | (a) base |" in done.stdout
    assert [result["rows"] for result in report["kernel_sweep"]] == [1, 8]


def test_the_folded_expand_sweep_checks_every_tiling_against_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    done = smoke_run("lora_step", tmp_path, "--folded-sweep")
    sweep = json.loads((tmp_path / "lora_step.json").read_text())["folded_expand_sweep"]
    assert [result["rows"] for result in sweep] == [1, 8]
    assert all(len(result["sweep_us"]) == 12 for result in sweep)
    assert "folded expand, 8 rows: best" in done.stdout


def test_the_prefill_step_runs_base_segmented_and_folded_with_the_same_lora_output(tmp_path):
    done = smoke_run("lora_step", tmp_path, "--prefill", "1")
    prefill = json.loads((tmp_path / "lora_step.json").read_text())["prefill"]
    assert prefill["tokens"] == 512 and all(prefill[case] > 0 for case in ("base", "segmented", "folded"))
    assert prefill["lora_vs_base_rel_diff"] > 1e-3 and prefill["folded_vs_segmented_rel_diff"] < 1e-5, prefill
    assert "prefill step of 512 tokens: base" in done.stdout
