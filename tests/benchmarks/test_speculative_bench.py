"""The speculative-decoding GPU benchmark's own path, as a dry run on the CPU: a tiny Llama (Llama-3's
vocabulary, --load-format dummy) in two engine processes, speculation off and on (n-gram, or a random EAGLE-3
head) with synthetic acceptance. The EAGLE-3 run reads the n-gram run's --speculate 0 numbers (--plain-from)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.device.speculative import CPU_WORKLOADS, GPU_WORKLOADS, code_edit_histogram, main, prompts_of


def test_the_code_edit_histogram_is_the_measured_one():
    assert code_edit_histogram() == [137.0, 57.0, 20.0, 10.0, 570.0]


@pytest.mark.parametrize("workload", GPU_WORKLOADS[1:3], ids=["code-edit", "sharegpt"])
def test_each_rows_warm_up_has_its_shape_and_other_ids(workload):
    timed, warm = prompts_of(workload, seed=2), prompts_of(workload, seed=2, ids_seed=1)
    assert [(len(p), n) for p, n in warm] == [(len(p), n) for p, n in timed]
    assert all(w != t for (w, _), (t, _) in zip(warm, timed))  # (nothing for the prefix cache to share)


def _args(folder: Path, method: str) -> list[str]:
    return ["--device", "cpu", "--work-dir", str(folder), "--out", str(folder / "spec.json"), "--method", method]


@pytest.fixture(scope="module")
def ngram_run(tmp_path_factory) -> tuple[dict, Path]:
    """The whole path once, --speculate 0 included; the EAGLE-3 run takes its --speculate 0 numbers."""
    folder = tmp_path_factory.mktemp("spec-ngram")
    return main(_args(folder, "ngram")), folder / "spec.json"


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_the_benchmark_runs_on_the_cpu(ngram_run, tmp_path, method):
    ngram_report, ngram_json = ngram_run
    out = ngram_json if method == "ngram" else tmp_path / "spec.json"
    if method == "ngram":
        report = ngram_report
    else:
        report = main([*_args(tmp_path, method), "--plain-from", str(ngram_json)])
        assert report["plain"] == ngram_report["plain"]
    assert [row["workload"] for row in report["rows"]] == [w.name for w in CPU_WORKLOADS]
    for workload in CPU_WORKLOADS:
        expected = workload.streams * workload.new_tokens if workload.prompt_len else None
        for engine in ("plain", "speculative"):
            tokens = report[engine][workload.name]["tokens"]
            assert tokens > 0 and (expected is None or tokens == expected)
    assert out.exists()
