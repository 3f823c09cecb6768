"""The plain-path intra-op threads benchmark's CPU smoke (benchmarks/device/host_threads.py --device cpu): a tiny
Llama-3 engine with dummy weights runs each row count with one thread and with a thread a core, the table prints and
the JSON lands in $OUT."""

from __future__ import annotations

import json
import os
import sys

import torch

from benchmarks.device import host_threads


def test_the_benchmark_runs_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["host_threads", "--device", "cpu", "--rows", "2", "--new", "3", "--pairs", "1"])
    before = torch.get_num_threads()
    host_threads.main()
    assert torch.get_num_threads() == before  # (the engine's own count restored)
    assert "| streams | intra-op threads |" in capsys.readouterr().out
    results = json.loads((tmp_path / "host_threads.json").read_text())
    assert {run["threads"] for run in results["runs"]} == {1, os.cpu_count() or 1}
    assert all(run["tok_s"] > 0 and run["rows"] == 2 for run in results["runs"])
    assert results["one_vs_many_2"] > 0
