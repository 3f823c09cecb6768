"""CPU cost of the HTTP API process per streamed token, measured on the real launcher.

    python -m benchmarks.api_overhead [--runs 3] [--num-prompts 128] [--concurrency 64]

What it launches: ``python -m tgi_compat.api.cli.launcher`` (the API process; the engine is its spawned
child) on a tiny random-weight Llama (1 layer, hidden 64) with SmolLM2's tokenizer, so the engine
step is cheap and the per-token work of the API process (ZeroMQ receive, dispatch, detokenize,
JSON, SSE, HTTP writes) is what the run exercises. The model folder is built once under
``--model-dir``. The client is ``benchmarks.runner``: ``--concurrency`` streams of
POST /generate_stream at a time, ``--num-prompts`` prompts of ``--input-len`` tokens asking for
``--output-len`` new tokens each (greedy; a random model may hit EOS early: tokens are counted).

What it prints, per run and as a mean: the API process's CPU time (user + system, from
/proc/<pid>/stat, all its threads) divided by the tokens streamed during the run, in microseconds
per token, and the client-observed output throughput (streamed tokens / wall-clock run time).
The engine process's CPU per token is printed too, for context. On a small box the engine, the
API process and this client share the cores, so compare tok/s only between runs on one machine;
CPU us/token is the figure that carries over.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.backends import BackendOptions
from benchmarks.runner import run_benchmark, warm_up
from benchmarks.server_process import free_port, running_server
from benchmarks.tokenizer import default_model_id, load_tokenizer
from benchmarks.workload import build_workload

DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "tgi-compat-api-overhead" / "tiny-llama"
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


@dataclass
class RunFigures:
    tokens: int
    duration_s: float
    api_cpu_s: float
    engine_cpu_s: float
    ended_early: int

    @property
    def api_us_per_token(self) -> float:
        return self.api_cpu_s / self.tokens * 1e6

    @property
    def engine_us_per_token(self) -> float:
        return self.engine_cpu_s / self.tokens * 1e6

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s


def build_tiny_model(model_dir: Path) -> Path:
    """A 1-layer random Llama with SmolLM2's vocabulary and tokenizer (built once, then reused)."""
    if (model_dir / "config.json").exists():
        return model_dir
    from benchmarks.random_model import write_random_llama

    tokenizer = load_tokenizer(default_model_id())
    tokenizer_dir = model_dir.parent / "smollm2-tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    overrides = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        num_hidden_layers=1,
        max_position_embeddings=2048,
    )
    write_random_llama(model_dir, "llama3-tiny", "cpu", "float32", tokenizer_dir, overrides=overrides)
    return model_dir


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_SECOND  # utime, stime


def child_pids(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def measure(samples, opts: BackendOptions, api_pid: int, concurrency: int) -> RunFigures:
    processes = [api_pid, *child_pids(api_pid)]
    before = [cpu_seconds(pid) for pid in processes]
    run = run_benchmark(samples, "tgi", opts, math.inf, max_concurrency=concurrency, show_progress=False)
    after = [cpu_seconds(pid) for pid in processes]
    failed = [r.error for r in run.records if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    spent = [b - a for a, b in zip(before, after)]
    return RunFigures(
        tokens=sum(r.output_tokens for r in run.records),
        duration_s=run.duration_s,
        api_cpu_s=spent[0],
        engine_cpu_s=sum(spent[1:]),
        ended_early=sum(r.output_tokens < r.max_new_tokens for r in run.records),
    )


def report(label: str, figures: RunFigures) -> None:
    print(
        f"{label}: {figures.tokens} tokens in {figures.duration_s:.2f} s = {figures.tokens_per_s:.0f} out tok/s; "
        f"API CPU {figures.api_cpu_s:.2f} s = {figures.api_us_per_token:.1f} us/token; "
        f"engine CPU {figures.engine_us_per_token:.1f} us/token; ended early {figures.ended_early}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.api_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--server-args", default="", help="extra launcher flags, one shell-quoted string")
    parser.add_argument("--server-log", type=Path, default=None)
    args = parser.parse_args(argv)

    model_dir = build_tiny_model(args.model_dir)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "tgi_compat.api.cli.launcher",
        "--model-id",
        str(model_dir),
        "--hostname",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-concurrent-requests",
        str(max(256, args.concurrency)),
        *shlex.split(args.server_args),
    ]
    samples = build_workload(
        load_tokenizer(str(model_dir)), "fixed", args.num_prompts, input_len=args.input_len, output_len=args.output_len
    )
    opts = BackendOptions(base_url=base_url)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with running_server(shlex.join(command), base_url, 300.0, args.server_log) as server:
        warm_up(samples, "tgi", opts)
        runs = []
        for index in range(args.runs):
            runs.append(measure(samples, opts, server.pid, args.concurrency))
            report(f"run {index + 1}", runs[-1])
    mean = RunFigures(
        tokens=round(statistics.mean(r.tokens for r in runs)),
        duration_s=statistics.mean(r.duration_s for r in runs),
        api_cpu_s=statistics.mean(r.api_cpu_s for r in runs),
        engine_cpu_s=statistics.mean(r.engine_cpu_s for r in runs),
        ended_early=round(statistics.mean(r.ended_early for r in runs)),
    )
    report(f"mean of {len(runs)}", mean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
