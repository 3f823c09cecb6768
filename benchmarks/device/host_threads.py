"""The plain path with the engine's host work on one PyTorch intra-op thread (a GPU engine's default since session 42,
router/model_loading._gpu_host_threads) against a thread a core, alternating (not CI; in-process EngineCore, no HTTP).

    python3 -m benchmarks.device.host_threads                     # random Llama-3-8B, bf16, 64 and 256 streams: ~2 min
    python3 -m benchmarks.device.host_threads --device cpu --rows 2 --new 3    # the CPU smoke (a test)

Dummy weights from the config (`--load-format dummy`: nothing read from disk), the engine as the server builds it
(CUDA graphs, overlap scheduling); per row count, `--pairs` pairs of runs of `rows` requests of 256 random ids in and
`--new` out (ignore_eos), all at once, the order within a pair swapped each time: output tok/s and the median
request's time per output token (first token to last). The bar: the plain path within 3% (one thread may not cost).
A markdown table on stdout, JSON in $OUT/host_threads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.device.engine_load import Stream, random_prompts, request
from benchmarks.device.timing import out_path, write_json
from benchmarks.shapes import LLAMA3_8B, LLAMA3_TINY
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.model_loading import load_runner

PROMPT = 256


def run(engine: EngineCore, rows: int, new: int, seed: int) -> dict:
    """`rows` requests at once until all end: output tok/s and the median request's ms per output token."""
    streams: dict[str, Stream] = {}
    start = time.perf_counter()
    for prompt in random_prompts(random.Random(seed), rows, PROMPT):
        req = request(prompt, new)
        engine.add_request(req)
        streams[req.request_id] = Stream(start)
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            stream = streams[event.request_id]
            stream.arrivals.append(now)
            stream.events.append(1)
            stream.tokens += len(event.token_ids)
    elapsed = time.perf_counter() - start
    tokens = sum(stream.tokens for stream in streams.values())
    return dict(tok_s=tokens / elapsed, tpot_ms=statistics.median(s.ms_per_token() for s in streams.values()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="host-threads-"))
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B if args.device == "cuda" else LLAMA3_TINY))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    rows = [int(r) for r in args.rows.split(",")]
    config = EngineConfig(
        model_id=str(folder), device=args.device, dtype=dtype, load_format="dummy", max_running_requests=max(rows)
    )
    runner = load_runner(config)
    engine = EngineCore(config, runner, runner.model_config, runner.lora)
    default, many = torch.get_num_threads(), os.cpu_count() or 1
    run(engine, 8, 8, seed=0)  # warm-up
    results: dict = dict(default_threads=default, runs=[])
    for count in rows:
        for pair in range(args.pairs):
            for threads in (1, many) if pair % 2 == 0 else (many, 1):
                torch.set_num_threads(threads)
                timed = run(engine, count, args.new, seed=1000 * count + 10 * pair + threads)
                results["runs"].append(dict(rows=count, threads=threads, **timed))
    torch.set_num_threads(default)
    lines = ["| streams | intra-op threads | out tok/s | TPOT p50 ms |", "|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['threads']} | {r['tok_s']:.0f} | {r['tpot_ms']:.2f} |" for r in results["runs"]]
    for count in rows:
        mean = {
            threads: statistics.mean(
                r["tok_s"] for r in results["runs"] if r["rows"] == count and r["threads"] == threads
            )
            for threads in (1, many)
        }
        results[f"one_vs_many_{count}"] = mean[1] / mean[many]
        lines.append(f"\n{count} streams: one thread / {many} threads, mean out tok/s: {mean[1] / mean[many]:.3f}")
    print("\n".join(lines), flush=True)
    write_json(out_path("host_threads.json"), results)


if __name__ == "__main__":
    main()
