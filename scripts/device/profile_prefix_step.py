"""Where a prefix-cache hit's prefill step spends its time (GPU, not CI): a 4,000-token system prompt
cached, then N requests of it + a distinct 64-token question, one new token each, through
tgi_compat.router.offline.LLM; per-step wall times, then a torch profile of one such batch (top kernels).

    python3 scripts/device/profile_prefix_step.py /tmp/model [--requests 16] [--system-len 4000]
"""

import argparse
import random
import time

import torch

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.offline import LLM
from tgi_compat.router.request import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("model_dir")
parser.add_argument("--requests", type=int, default=16)
parser.add_argument("--system-len", type=int, default=4000)
parser.add_argument("--question-len", type=int, default=64)
args = parser.parse_args()

llm = LLM(EngineConfig(model_id=args.model_dir))
rng = random.Random(0)
system = [rng.randrange(1000, 100000) for _ in range(args.system_len)]


def batch(n: int) -> list[list[int]]:
    return [system + [rng.randrange(1000, 100000) for _ in range(args.question_len)] for _ in range(n)]


engine = llm.engine
step_times: list[tuple[float, int]] = []
original_step = engine.step


def timed_step():
    torch.cuda.synchronize()
    start = time.perf_counter()
    events = original_step()
    torch.cuda.synchronize()
    step_times.append((time.perf_counter() - start, len(events)))
    return events


engine.step = timed_step
llm.generate(batch(1), SamplingParams(), max_new_tokens=2)  # caches the system prompt
for n in (1, 4, args.requests, args.requests):  # compiles the shapes
    llm.generate(batch(n), SamplingParams(), max_new_tokens=1)
for n in (1, 4, args.requests):
    step_times.clear()
    start = time.perf_counter()
    llm.generate(batch(n), SamplingParams(), max_new_tokens=1)
    total = time.perf_counter() - start
    steps = ", ".join(f"{1000 * t:.1f} ms ({e} events)" for t, e in step_times)
    print(f"{n} cached-prefix requests, 1 new token: {1000 * total:.1f} ms; steps: {steps}", flush=True)

with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
) as prof:
    llm.generate(batch(args.requests), SamplingParams(), max_new_tokens=1)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


import cProfile  # noqa: E402  (host side of the same batch, after the device profile)
import pstats  # noqa: E402

profiler = cProfile.Profile()
profiler.enable()
llm.generate(batch(args.requests), SamplingParams(), max_new_tokens=1)
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
