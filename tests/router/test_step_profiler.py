"""The in-server step profiler: off by default, and with TGI_PROFILE_DIR set it writes one summary and
one trace per window, counted in forwards."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from tgi_compat.modeling.step_profiler import StepProfiler, parse_windows
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.offline import LLM


def test_windows_parse_and_sort():
    assert parse_windows("30:5, 2:3,7") == [(2, 3), (7, 1), (30, 5)]
    with pytest.raises(ValueError):
        parse_windows("3:0")


def test_off_without_the_environment(monkeypatch):
    monkeypatch.delenv("TGI_PROFILE_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert StepProfiler.from_env(rank=0) is None


def test_profiles_the_chosen_forward_steps(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("TGI_PROFILE_STEPS", "1:3,6:2")
    llm = LLM(EngineConfig(model_id=tiny_llama_dir, max_batch_total_tokens=1024))
    llm.generate([[5, 6, 7]], max_new_tokens=12, ignore_eos=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank0-steps1.json.gz",
        "rank0-steps1.txt",
        "rank0-steps6.json.gz",
        "rank0-steps6.txt",
    ]
    summary = (tmp_path / "rank0-steps1.txt").read_text()
    assert summary.startswith("rank 0, forward steps 1..4: wall ")
    assert "aten::" in summary  # the op table
    # the engine's named regions, with their host time per step (this tiny model: a forward and a sampling a step)
    regions = {line.split()[0]: line.split()[1:] for line in summary.splitlines() if line.startswith("step.")}
    assert {"step.build", "step.forward", "step.sample"} <= regions.keys(), summary
    assert float(regions["step.forward"][1]) > 0
    with gzip.open(tmp_path / "rank0-steps6.json.gz") as f:
        assert json.load(f)["traceEvents"]


def test_regions_are_free_outside_a_window():
    """Outside a window, a region records nothing: no RecordFunction on the steps' path."""
    from tgi_compat.modeling import step_profiler

    with torch.profiler.profile() as profile, step_profiler.region("step.forward"):
        torch.ones(2).add_(1)
    assert "step.forward" not in {event.key for event in profile.key_averages()}
