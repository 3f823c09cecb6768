"""benchmarks.serve / benchmarks.offline against the real server on the embedded model.

Kept to a few seconds of load: a handful of ShareGPT prompts with outputs capped at a few tokens.
The checks are about the benchmark's bookkeeping, not the server's speed.
"""

import json

import pytest

from benchmarks import offline, serve

NUM_PROMPTS = 3
MAX_OUTPUT = 5


def _read(out_dir):
    return json.loads((out_dir / "result.json").read_text())


def check_run_consistency(run: dict, backend: str, max_output: int = MAX_OUTPUT) -> None:
    summary, requests = run["summary"], run["requests"]
    assert summary["completed"] == summary["num_requests"] == len(requests)
    assert all(r["error"] is None for r in requests)
    for r in requests:
        # The server's own counts agree with ours and with what was streamed.
        assert r["server_prompt_tokens"] == r["prompt_len"]
        assert 1 <= r["output_tokens"] <= r["max_new_tokens"] <= max_output
        if backend == "tgi":
            assert r["num_chunks"] == r["output_tokens"]  # one SSE event per token
        if r["output_tokens"] < r["max_new_tokens"]:
            assert r["finish_reason"] in ("eos_token", "stop_sequence", "stop")
        assert 0 < r["ttft_s"] <= r["e2e_s"]
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert summary["total_input_tokens"] == sum(r["prompt_len"] for r in requests)
    assert summary["ended_early"] == sum(r["output_tokens"] < r["max_new_tokens"] for r in requests)
    duration = summary["duration_s"]
    assert duration >= max(r["send_s"] + r["e2e_s"] for r in requests) - 1e-6
    assert summary["output_throughput"] == pytest.approx(summary["total_output_tokens"] / duration)
    assert summary["request_throughput"] == pytest.approx(len(requests) / duration)
    assert summary["itl"]["count"] == sum(r["num_chunks"] - 1 for r in requests)
    for key in ("ttft", "tpot", "itl", "e2e"):
        d = summary[key]
        assert d["median_ms"] <= d["p90_ms"] <= d["p99_ms"] <= d["max_ms"], key
    assert summary["ttft"]["max_ms"] <= summary["e2e"]["max_ms"]
    timeline = run["timeline"]
    binned = sum(timeline["output_tokens_per_s"]) * timeline["bin_s"]
    assert binned == pytest.approx(summary["total_output_tokens"])


def check_report_files(out_dir, images: list[str]) -> None:
    page = (out_dir / "index.html").read_text()
    for name in images:
        png = out_dir / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 5_000, name
        assert f'src="{name}"' in page


def test_serve_sharegpt_two_rates_tgi_stream(server_url, tmp_path):
    out = tmp_path / "serve"
    flags = f"--dataset sharegpt --num-prompts {NUM_PROMPTS} --max-output-len {MAX_OUTPUT} --request-rate 20,inf"
    code = serve.main(["--base-url", server_url, "--out-dir", str(out), *flags.split(), "--no-progress", "--no-warmup"])
    assert code == 0
    result = _read(out)
    assert result["config"]["endpoint"] == "/generate_stream"
    assert result["config"]["outputs_may_end_early"] is True
    assert result["config"]["tokenizer"] == result["config"]["server_info"]["model_id"]
    assert [run["request_rate"] for run in result["runs"]] == [20.0, "inf"]
    for run in result["runs"]:
        check_run_consistency(run, "tgi")
    check_report_files(out, ["latency_cdf.png", "throughput_over_time.png", "latency_vs_rate.png"])


def test_serve_openai_completions_with_concurrency_cap(server_url, tmp_path):
    out = tmp_path / "openai"
    flags = f"--backend openai --dataset fixed --input-len 12 --output-len {MAX_OUTPUT} --num-prompts 3"
    flags += " --max-concurrency 2 --no-progress --no-warmup"
    code = serve.main(["--base-url", server_url, "--out-dir", str(out), *flags.split()])
    assert code == 0
    result = _read(out)
    assert result["config"]["endpoint"] == "/v1/completions"
    (run,) = result["runs"]
    assert run["max_concurrency"] == 2
    # Synthesized prompts have exactly the asked length (the SmolLM2 tokenizer adds no BOS).
    assert {r["prompt_len"] for r in run["requests"]} == {12}
    check_run_consistency(run, "openai")
    check_report_files(out, ["latency_cdf.png", "throughput_over_time.png"])


def test_offline_server_vs_transformers_static_batching(tiny_server_cmd, tiny_model_dir, tmp_path):
    """One offline run: start the server, all requests at once, stop it, then transformers."""
    out = tmp_path / "offline"
    command, url = tiny_server_cmd
    flags = "--dataset sharegpt-lengths --num-prompts 3 --max-output-len 4 --hf-batch-size 2 --hf-dtype float32"
    flags += " --no-progress"
    code = offline.main(
        [
            "--server-cmd",
            command,
            "--base-url",
            url,
            "--hf-model",
            str(tiny_model_dir),
            "--out-dir",
            str(out),
            *flags.split(),
        ]
    )
    assert code == 0
    result = _read(out)
    (run,) = result["runs"]
    assert run["request_rate"] == "inf"
    check_run_consistency(run, "tgi", max_output=4)
    comparison = result["comparison"]
    assert comparison["server_output_tok_per_s"] == pytest.approx(run["summary"]["output_throughput"])
    hf = comparison["hf_static"]
    assert hf["num_requests"] == 3 and hf["batch_size"] == 2
    # Each request asked for its capped reference length; static batching pads to the batch maximum.
    assert 3 <= hf["useful_output_tokens"] <= sum(r["max_new_tokens"] for r in run["requests"])
    assert hf["generated_slots"] >= hf["useful_output_tokens"]
    assert hf["output_throughput"] == pytest.approx(hf["useful_output_tokens"] / hf["duration_s"])
    assert comparison["server_over_hf_output_throughput"] == pytest.approx(
        comparison["server_output_tok_per_s"] / comparison["hf_static_output_tok_per_s"]
    )
    assert "Offline comparison" in (out / "index.html").read_text()
    assert (out / "server.log").read_text()  # the server really ran
