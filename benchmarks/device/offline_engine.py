"""Engine-only offline ShareGPT throughput and where the steps go (not CI; no HTTP).

    python3 -m benchmarks.device.offline_engine [MODEL_DIR] [--configs 256:4096,512:4096,...]

The 1,000-prompt ShareGPT length list of benchmarks.offline (same seed), random token ids of those
lengths, each request's own output length with ignore_eos, all submitted at once to an in-process
EngineCore (tgi_compat.router.offline's engine, no HTTP). For each max_running_requests:max_batch_prefill_tokens
pair it prints output tok/s and a step breakdown: pure-decode steps (CUDA graphs up to 256 rows) vs
steps that carry prompt tokens, their count, wall time and mean rows, so the engine's ceiling can be
told apart from the HTTP path's cost (compare with benchmarks.offline against the server).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from benchmarks.device.timing import out_path, write_json
from benchmarks.workload import read_length_list
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.model_loading import load_runner
from tgi_compat.router.request import GenerateRequest


def sharegpt_lengths(num: int, seed: int = 0) -> list[tuple[int, int]]:
    rows = read_length_list()
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))[:num]]


def run(engine: EngineCore, lengths: list[tuple[int, int]], tag: str) -> dict:
    rng = random.Random(0)
    for i, (prompt_len, output_len) in enumerate(lengths):
        prompt = [rng.randrange(1000, 100000) for _ in range(prompt_len)]
        engine.add_request(GenerateRequest(f"{tag}-{i}", prompt, max_new_tokens=output_len, ignore_eos=True))
    plans = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recording_schedule
    steps = []
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        events = engine.step()
        plan = plans[-1]
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if c.start < c.request.num_prompt_tokens)
        steps.append((time.perf_counter() - t0, len(plan.chunks), prompt_tokens))
        generated += sum(len(e.token_ids) for e in events)
    elapsed = time.perf_counter() - start
    engine.scheduler.schedule = schedule
    decode = [s for s in steps if s[2] == 0]
    mixed = [s for s in steps if s[2] > 0]

    def summary(group):
        if not group:
            return dict(count=0)
        return dict(
            count=len(group),
            seconds=sum(s[0] for s in group),
            mean_ms=1e3 * np.mean([s[0] for s in group]),
            mean_rows=float(np.mean([s[1] for s in group])),
            mean_prompt_tokens=float(np.mean([s[2] for s in group])),
        )

    return dict(
        elapsed_s=elapsed,
        generated=generated,
        out_tok_s=generated / elapsed,
        decode_steps=summary(decode),
        prompt_steps=summary(mixed),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?", default="/tmp/llama3-8b-random")
    parser.add_argument("--configs", default="256:4096,512:4096,512:8192")
    parser.add_argument("--num-prompts", type=int, default=1000)
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    max_rows = max(rows for rows, _ in configs)
    base = EngineConfig(
        model_id=args.model_dir, max_running_requests=max_rows, max_batch_prefill_tokens=max(p for _, p in configs)
    )
    runner = load_runner(base)
    lengths = sharegpt_lengths(args.num_prompts)
    warm = EngineCore(base, runner, runner.model_config)
    run(warm, lengths[:64], "warmup")
    results = {}
    for rows, prefill in configs:
        config = EngineConfig(model_id=args.model_dir, max_running_requests=rows, max_batch_prefill_tokens=prefill)
        engine = EngineCore(config, runner, runner.model_config)
        result = run(engine, lengths, f"r{rows}p{prefill}")
        results[f"{rows}:{prefill}"] = result
        d, m = result["decode_steps"], result["prompt_steps"]
        print(
            f"max_running {rows:4d} prefill {prefill:5d}: {result['out_tok_s']:7.0f} out tok/s in "
            f"{result['elapsed_s']:.1f} s | decode steps {d.get('count', 0)} x {d.get('mean_ms', 0):.1f} ms "
            f"(rows {d.get('mean_rows', 0):.0f}) = {d.get('seconds', 0):.1f} s | prompt steps {m.get('count', 0)} x "
            f"{m.get('mean_ms', 0):.1f} ms (rows {m.get('mean_rows', 0):.0f}, prompt tokens "
            f"{m.get('mean_prompt_tokens', 0):.0f}) = {m.get('seconds', 0):.1f} s",
            flush=True,
        )
    write_json(out_path("profile_offline.json"), results)


if __name__ == "__main__":
    main()
