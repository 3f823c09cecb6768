"""Arguments and helpers shared by ``benchmarks.serve`` and ``benchmarks.offline``."""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.request
from dataclasses import replace

from benchmarks.backends import BackendOptions
from benchmarks.tokenizer import load_tokenizer
from benchmarks.workload import Sample, build_workload


def add_endpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("endpoint")
    group.add_argument(
        "--base-url", default="http://127.0.0.1:3000", help="server root, e.g. http://127.0.0.1:3000 (no route suffix)"
    )
    group.add_argument(
        "--backend",
        choices=("tgi", "openai"),
        default="tgi",
        help="tgi: POST /generate_stream; openai: POST /v1/completions (stream)",
    )
    group.add_argument("--model", default="tgi", help="'model' field for the openai backend")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos=true (openai backend only; vLLM/SGLang honour it)"
    )


def add_workload_args(parser: argparse.ArgumentParser, default_num: int) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--tokenizer", default=None, help="local folder, .gguf file or hub id; default: the server's /info model_id"
    )
    group.add_argument(
        "--dataset", default="sharegpt", choices=("sharegpt", "sharegpt-lengths", "sharegpt-like", "fixed")
    )
    group.add_argument("--num-prompts", type=int, default=default_num)
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens for --dataset fixed")
    group.add_argument("--output-len", type=int, default=128, help="output tokens for --dataset fixed")
    group.add_argument(
        "--max-output-len", type=int, default=None, help="cap every reference output length (small CPU runs)"
    )
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--out-dir", default="bench-results")
    group.add_argument("--no-progress", action="store_true")


def parse_rates(text: str) -> list[float]:
    """'1,4,16,inf' -> [1.0, 4.0, 16.0, inf]."""
    return [math.inf if part.strip().lower() == "inf" else float(part) for part in text.split(",")]


def fetch_info(base_url: str, timeout_s: float = 10.0) -> dict | None:
    """The server's TGI /info, or None (OpenAI-only servers have none)."""
    try:
        with urllib.request.urlopen(f"{base_url}/info", timeout=timeout_s) as resp:
            return json.load(resp)
    except (OSError, ValueError):
        return None


def wait_for_health(base_url: str, timeout_s: float, is_alive=lambda: True) -> None:
    """Poll GET /health until 200; give up after ``timeout_s`` or when ``is_alive()`` turns false."""
    deadline = time.monotonic() + timeout_s
    while is_alive():
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health not ready after {timeout_s:.0f} s")
        time.sleep(0.2)
    raise TimeoutError(f"server process exited before {base_url}/health answered")


def prepare_workload(args: argparse.Namespace, info: dict | None) -> tuple[list[Sample], str]:
    """Load the tokenizer (explicit, else the server's model_id) and build the samples."""
    tokenizer_id = args.tokenizer or (info or {}).get("model_id")
    if tokenizer_id is None:
        raise SystemExit("no --tokenizer given and the server has no /info model_id")
    tokenizer = load_tokenizer(tokenizer_id)
    samples = build_workload(tokenizer, args.dataset, args.num_prompts, args.seed, args.input_len, args.output_len)
    if args.max_output_len:
        samples = [replace(s, output_len=min(s.output_len, args.max_output_len)) for s in samples]
    return samples, tokenizer_id


def backend_options(args: argparse.Namespace) -> BackendOptions:
    return BackendOptions(args.base_url.rstrip("/"), args.model, args.temperature, args.ignore_eos)


def workload_stats(samples: list[Sample]) -> dict:
    prompt = [s.prompt_len for s in samples]
    output = [s.output_len for s in samples]
    return {
        "num_requests": len(samples),
        "mean_prompt_len": sum(prompt) / len(prompt),
        "mean_output_len": sum(output) / len(output),
        "max_prompt_len": max(prompt),
        "max_output_len": max(output),
    }


def early_stop_note(args: argparse.Namespace) -> str:
    if args.ignore_eos and args.backend == "openai":
        return "ignore_eos was sent: outputs should reach max_tokens = reference length."
    return (
        "max_new_tokens = reference output length, but the TGI API has no ignore_eos: outputs can "
        "end early at EOS (see 'ended_early' per run)."
    )
