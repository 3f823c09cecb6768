"""The Qwen2.5-VL TTFT benchmark's CPU smoke (benchmarks/device/qwen_vl.py --device cpu --preset tiny), and with
Qwen2-VL's vision tower (--family qwen2_vl): every phase runs through the real engine with dummy weights (images
loaded and resized by the API's own fetcher in a process of its own on the phase's clock, the same resized before it and with
their rows cached, their text stand-ins, a repeated image, text-only on the VL and on a plain Qwen2 engine, the
images phase again, and again with the API's decoders in a worker process), the encoder's ms per image at 1 and 8
images a call, the table prints and the JSON lands in $OUT."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.device import qwen_vl


@pytest.mark.parametrize("family", sorted(qwen_vl.FAMILIES))
def test_the_benchmark_runs_on_cpu(tmp_path, monkeypatch, capsys, family):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["qwen_vl", "--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--family", family]
    argv += ["--streams", "2", "--new", "3", "--size", "112", "--text", "8", "--reruns", "1", "--engine-side"]
    if family == "qwen2_5_vl":  # the API's decoders in a worker process (the server's own on a host of 4+ cores)
        argv += ["--api-processes", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    qwen_vl.main()
    out = capsys.readouterr().out
    assert "| images |" in out and "| 8 |" in out
    results = json.loads((tmp_path / ("qwen_vl.json" if family == "qwen2_5_vl" else f"{family}.json")).read_text())
    assert results["grid"] == [4, 4]
    assert set(results["encoder"]) == {"1", "8"} and results["encoder"]["8"]["encode_ms_per_image"] > 0
    checks = {"image_vs_text", "repeat_vs_first", "encoder_floor", "text_only_vl_vs_plain", "preprocessed_vs_text"}
    assert set(results["checks"]) == checks | {"cached_vs_text"}
    # every phase's images came resized (by the API's half): the engine never waited on a processor thread; the
    # cached phase's were in the encoder cache: none encoded
    for phase in ("images", "images_preprocessed"):
        assert results[f"{phase}_encoder"]["images"] == 2 and results[f"{phase}_encoder"]["preprocess_wait_ms"] < 1.0
    assert results["images_cached_encoder"]["images"] == 0
    assert results["checks"]["encoder_floor"] > 1.0  # the median's image at least was encoded before its first token
    again = results["images_again_0"]  # new images again (encoded again)
    assert again["encoder"]["images"] == 2 and "images again (1)" in out
    assert results["images_engine_side_0"]["encoder"]["images"] == 2 and "images engine-side (1)" in out
    if family == "qwen2_5_vl":
        decoders = results["images_api_processes_1_0"]
        assert decoders["encoder"]["images"] == 2 and "images api-processes-1 (1)" in out


def test_the_encoder_floor_counts_the_images_until_the_median_first_token():
    """4 streams: the median (2nd) first token comes at the second step, after 3 + 3 images; at 5 ms an image (the
    best of the encoder's call sizes) over a 100 ms text p50: 1.3."""
    steps = [(10.0, 0, 3), (20.0, 2, 3), (30.0, 2, 2)]
    results = dict(images=dict(steps=steps), text=dict(ttft_p50_ms=100.0),
                   encoder={"1": dict(encode_ms_per_image=7.0), "8": dict(encode_ms_per_image=5.0)})  # fmt: skip
    assert qwen_vl.encoder_floor(results) == pytest.approx(1.3)
