"""benchmarks/device/vision_encoder.py's CPU smoke run (tiny Qwen2.5-VL tower, Triton interpreted): every part, the
fused kernels' rows, each CPU attention backend (errors against the fp32 reference at 1 image) and the tile sweep
run, and the table and the JSON are written."""

from __future__ import annotations

import json

from tests.benchmarks.smoke import smoke_run
from tgi_compat.modeling.vision.qwen_vl_ops import DEFAULT_VISION_ATTENTION


def test_vision_encoder_benchmark_smoke_run(tmp_path):
    done = smoke_run("vision_encoder", tmp_path, "--reps", "1")
    report = json.loads((tmp_path / "vision_encoder.json").read_text())
    assert report["grid"] == [1, 8, 8] and set(report["counts"]) == {"1", "2"}
    one = report["counts"]["1"]
    assert one["parts"]["qkv"]["flop"] > 0 and all(row["ms"] > 0 for row in one["parts"].values())
    assert set(one["backends"]) == {"sdpa", "triton"}
    assert all(row["window_rel_err"] < 1e-5 and row["full_rel_err"] < 1e-5 for row in one["backends"].values())
    assert [row["window_ms"] > 0 for row in report["tiles"]] == [True, True]
    default = DEFAULT_VISION_ATTENTION.name  # (the parts run the encoder's own backend)
    assert f"| attention window ({default}) |" in done.stdout and "| triton |" in done.stdout
