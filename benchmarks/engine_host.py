"""Host (CPU) time of the router per engine step, with no model: what the GPU waits for each step.

    .venv/bin/python -m benchmarks.engine_host [--rows 64 256] [--prompt-len 300] [--new-tokens 128]
                                               [--vocab 128256] [--mixes greedy sampling]
                                               [--prefix-caching on off]

An EngineCore (tgi_compat/router/engine.py) is built around a runner whose forward hands back preallocated
logits [R, vocab] at once, so everything timed is router work: scheduling, batch building,
sampling setup, the sampler, the device-to-host copy, the update, stats, and the engine process's
msgspec encode of each step's StepOutputs (tgi_compat/router/engine_process.py does that every step).
Requests have `--prompt-len` (+-10%) prompt tokens, `--new-tokens` new tokens and ignore EOS, so
every request runs to the same length.

Mixes:
  greedy    every request greedy
  sampling  3 of 4 rows sample (temperature / top_p / top_k in turn), 1 of 4 greedy; every third
            row has a repetition penalty, every fifth a frequency penalty

Prompts are random, so nothing is shared: `--prefix-caching on off` measures what the prefix cache
costs the plain path (its match at admission, inserts at the first token and at the finish).
`all steps` is the summed wall time of every step of the run, prefills and finishes included.

Only decode steps (every chunk one token over a cached prefix) are reported, as milliseconds per
step (median over steps; mean in brackets), split by phase. `sampler math` is the sampler's tensor
work, which on CPU at a 128k vocabulary costs far more than on a GPU: it is reported beside, not in,
`host total`, the Python/bookkeeping time a GPU host also pays. `tensor builds` counts
torch.tensor/as_tensor calls per step: on a GPU each one is a separate host-to-device copy
(~10-20 us of host time each), so fewer is better even where the CPU timing barely moves.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest, SamplingParams
from tgi_compat.router.sampling.output import SampledRows, SamplerOutput
from tgi_compat.router.wire import StepOutputs, encoder

BOOKKEEPING_PHASES = (
    "schedule",
    "build batch",
    "sampling setup",
    "start copy",
    "to_host",
    "update",
    "stats",
    "wire encode",
)


class InstantRunner:
    """A model that costs nothing: forward returns the first R rows of fixed random logits."""

    def __init__(self, vocab: int, max_rows: int, num_kv_slots: int) -> None:
        self.num_kv_slots = num_kv_slots
        self.max_seq_len = 1 << 20  # no positions table: any length
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.logits = torch.randn(max_rows, vocab, generator=torch.Generator().manual_seed(0))

    def forward(self, batch) -> torch.Tensor:
        return self.logits[: batch.logits_indices.shape[0]]


class PhaseClock:
    """Wall time per phase within the current step, collected by wrapping the engine's calls."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.tensor_builds = 0
        self._patched: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - started

        self._patched.append((owner, name, owner.__dict__.get(name, inner)))
        setattr(owner, name, timed)

    def unwrap(self) -> None:
        """Undo every wrap (module and class attributes outlive one run)."""
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def take(self) -> dict[str, float]:
        step, self.current = dict(self.current), defaultdict(float)
        return step


@contextmanager
def count_tensor_builds(clock: PhaseClock):
    """Counts torch.tensor / torch.as_tensor calls (each an H2D copy when the device is a GPU)."""
    originals = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def counting(original):
        def build(*args, **kwargs):
            clock.tensor_builds += 1
            return original(*args, **kwargs)

        return build

    for name, original in originals.items():
        setattr(torch, name, counting(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def instrument(engine: EngineCore, clock: PhaseClock) -> None:
    """Wrap each phase of EngineCore.step (see tgi_compat/router/engine.py and tgi_compat/router/executor.py)."""
    executor = engine.executor
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "update", "update")
    clock.wrap(engine.stats, "record", "stats")
    clock.wrap(executor.batch_builder, "build", "build batch")
    clock.wrap(executor.selector, "_batch", "sampling setup")
    clock.wrap(executor.selector, "sampler", "sampler math")
    clock.wrap(SamplerOutput, "start_copy", "start copy")
    clock.wrap(SampledRows, "rows", "to_host")


def sampling_params(index: int, mix: str) -> SamplingParams:
    if mix == "greedy":
        return SamplingParams()
    kind = index % 4
    params = SamplingParams(
        do_sample=kind != 3,
        temperature=0.7 if kind == 0 else 1.0,
        top_p=0.9 if kind == 1 else 1.0,
        top_k=50 if kind == 2 else 0,
        seed=index,
    )
    if index % 3 == 0:
        params.repetition_penalty = 1.1
    if index % 5 == 0:
        params.frequency_penalty = 0.2
    return params


def instant_engine(runner: InstantRunner, vocab: int, max_positions: int, eos: int, **config) -> EngineCore:
    """An EngineCore around a model that costs nothing; `config`: EngineConfig's fields besides model_id."""
    model_config = SimpleNamespace(
        architecture="InstantForBenchmarks",
        multimodal_architecture=None,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        eos_token_ids=[eos],
    )
    return EngineCore(EngineConfig(model_id="instant", **config), runner, model_config)


def build_engine(rows: int, prompt_len: int, new_tokens: int, vocab: int, prefix_caching: bool = True) -> EngineCore:
    num_kv_slots = rows * (prompt_len * 2 + new_tokens) + 1024
    runner = InstantRunner(vocab, rows, num_kv_slots)
    return instant_engine(
        runner,
        vocab,
        8192,
        2,
        device="cpu",
        max_running_requests=rows,
        max_batch_prefill_tokens=16384,
        prefix_caching=prefix_caching,
    )


def run(
    rows: int, mix: str, prompt_len: int, new_tokens: int, vocab: int, prefix_caching: bool = True
) -> dict[str, list[float]]:
    """Every decode step's phase times (seconds), keyed by phase."""
    engine = build_engine(rows, prompt_len, new_tokens, vocab, prefix_caching)
    rng = random.Random(rows)
    for i in range(rows):
        length = rng.randint(int(prompt_len * 0.9), int(prompt_len * 1.1))
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        request = GenerateRequest(f"r{i}", prompt, sampling_params(i, mix), max_new_tokens=new_tokens, ignore_eos=True)
        engine.add_request(request)
    clock = PhaseClock()
    instrument(engine, clock)
    per_phase: dict[str, list[float]] = defaultdict(list)
    try:
        _drive(engine, clock, rows, per_phase)
    finally:
        clock.unwrap()
    return per_phase


def _drive(engine: EngineCore, clock: PhaseClock, rows: int, per_phase: dict[str, list[float]]) -> None:
    with torch.inference_mode(), count_tensor_builds(clock):
        while engine.has_unfinished():
            clock.tensor_builds = 0
            started = time.perf_counter()
            events = engine.step()
            step_s = time.perf_counter() - started
            encode_started = time.perf_counter()
            encoder.encode(StepOutputs(events))
            phases = clock.take()
            phases["wire encode"] = time.perf_counter() - encode_started
            phases["step (wall)"] = step_s
            per_phase["all steps"].append(step_s)
            if not _was_decode(engine, events, rows):
                continue
            phases["host total"] = step_s + phases["wire encode"] - phases.get("sampler math", 0.0)
            phases["other"] = phases["host total"] - sum(phases.get(p, 0.0) for p in BOOKKEEPING_PHASES)
            phases["tensor builds"] = clock.tensor_builds
            for phase, value in phases.items():
                per_phase[phase].append(value)


def _was_decode(engine: EngineCore, events, rows: int) -> bool:
    """A full-width decode step: every request got a token and none was prefilled this step."""
    steps = engine.stats.accumulator._steps
    return bool(steps) and steps[-1].method == "decode" and len(events) == rows


def report(rows: int, mix: str, per_phase: dict[str, list[float]]) -> None:
    steps = len(per_phase["step (wall)"])
    print(f"\n## {rows} rows, {mix}: {steps} decode steps")
    print("| phase | ms/step median | (mean) |")
    print("|---|---:|---:|")
    order = [*BOOKKEEPING_PHASES, "other", "host total", "sampler math", "step (wall)"]
    for phase in order:
        values = per_phase.get(phase)
        if values:
            print(f"| {phase} | {1e3 * statistics.median(values):.3f} | ({1e3 * statistics.fmean(values):.3f}) |")
    builds = per_phase.get("tensor builds")
    if builds:
        print(f"| tensor builds (count) | {statistics.median(builds):.0f} | ({statistics.fmean(builds):.1f}) |")
    print(f"| all steps (ms, summed) | {1e3 * sum(per_phase['all steps']):.1f} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--mixes", nargs="+", default=["greedy", "sampling"], choices=["greedy", "sampling"])
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--prefix-caching", nargs="+", default=["on"], choices=["on", "off"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"vocab {args.vocab}, prompt ~{args.prompt_len}, {args.new_tokens} new tokens, torch threads {torch.get_num_threads()}"
    )
    for rows in args.rows:
        for mix in args.mixes:
            for caching in args.prefix_caching:
                per_phase = run(rows, mix, args.prompt_len, args.new_tokens, args.vocab, caching == "on")
                report(rows, f"{mix}, prefix caching {caching}", per_phase)


if __name__ == "__main__":
    main()
