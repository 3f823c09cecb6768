"""The speculative-decoding GPU benchmark's own path, as a dry run on the CPU: a tiny Llama (Llama-3's
vocabulary, --load-format dummy) in two engine processes, speculation off and on (n-gram, or a random EAGLE-3
head) with synthetic acceptance."""

from __future__ import annotations

import pytest

from benchmarks.device.speculative import CPU_WORKLOADS, code_edit_histogram, main


def test_the_code_edit_histogram_is_the_measured_one():
    assert code_edit_histogram() == [137.0, 57.0, 20.0, 10.0, 570.0]


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_the_benchmark_runs_on_the_cpu(tmp_path, method):
    args = ["--device", "cpu", "--work-dir", str(tmp_path), "--out", str(tmp_path / "spec.json"), "--method", method]
    report = main(args)
    assert [row["workload"] for row in report["rows"]] == [w.name for w in CPU_WORKLOADS]
    for workload in CPU_WORKLOADS:
        expected = workload.streams * workload.new_tokens if workload.prompt_len else None
        for engine in ("plain", "speculative"):
            tokens = report[engine][workload.name]["tokens"]
            assert tokens > 0 and (expected is None or tokens == expected)
    assert (tmp_path / "spec.json").exists()
