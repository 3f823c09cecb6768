"""Engine-only throughput and a cProfile of its host work (no HTTP): 64 requests of 256 in / 256 out
through tgi_compat.router.offline.LLM on a model folder (default: the random Llama-3-8B of serve_bench.sh)."""

import cProfile
import pstats
import random
import sys
import time

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.offline import LLM
from tgi_compat.router.request import SamplingParams

model_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama3-8b-random"
batch, prompt_len, new_tokens = 64, 256, 256
llm = LLM(EngineConfig(model_id=model_dir))
rng = random.Random(0)
prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(batch)]
llm.generate(prompts[:4], SamplingParams(), max_new_tokens=8, ignore_eos=True)

start = time.perf_counter()
llm.generate(prompts, SamplingParams(), max_new_tokens=new_tokens, ignore_eos=True)
elapsed = time.perf_counter() - start
print(f"engine only: {batch}x{prompt_len}/{new_tokens}: {batch * new_tokens / elapsed:.0f} out tok/s ({elapsed:.2f} s)")

profiler = cProfile.Profile()
profiler.enable()
llm.generate(prompts, SamplingParams(), max_new_tokens=64, ignore_eos=True)
profiler.disable()
stats = pstats.Stats(profiler)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(30)
