"""Host cost of the prefix cache in a multi-turn chat replay, cache on against off (issue 16's chat row).

    .venv/bin/python -m benchmarks.prefix_host_cost [--conversations 128] [--turns 768] [--device cpu]
                                                    [--cprofile]

Issue 16's chat row (`benchmarks/device/prefix_side_by_side.sh`) replays ShareGPT conversations whose every
turn sends the whole history back, the server's own answers included: ~90% of a turn's prompt is cached.
This replays that pattern through a real EngineCore (scheduler, KV pool, radix tree, batch building,
sampling, update) around a model that costs nothing, so every millisecond timed is the engine's own:

- `--conversations` chats are in flight; each turn's answer is `--answer-len` tokens (EOS ignored), and
  the next turn's prompt is the previous prompt + that answer + `--new-len` fresh tokens, submitted
  `--think-steps` engine steps after the answer ends; after `--turns-per-conversation` turns a fresh
  conversation (a `--first-len` prompt) takes its place, until `--turns` turns were sent.
- The model (`RowWritingRunner`) does what ModelRunner.forward does with the batch besides the math:
  it writes the step's prefix hits and new slots into its req_to_token rows (on `--device`).
- Engine settings are the server's: TGI's batching hold (max_waiting_tokens 20, waiting ratio 0.3),
  4,096 prefill tokens a step, overlap scheduling on (as on a GPU; `--no-overlap` turns it off).

Printed per phase: host ms per step (mean over all steps) and us per turn (the phase's total over the
run / turns), cache on and off. Phases nest: an indented phase is part of the one above it.
On a GPU (`--device cuda`) the device work is a few index writes, so the times are the host's.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

import tgi_compat.router.batch as batch_module
import tgi_compat.router.scheduler as scheduler_module
from benchmarks.engine_host import InstantRunner, PhaseClock, instant_engine
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode
from tgi_compat.modeling.runner import write_cached_prefixes, write_new_slots
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.executor import LaunchedStep
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.wire import StepOutputs, encoder

EOS = 2
# (phase, depth): printed in this order, a deeper phase inside the shallower one above it
PHASES = (
    ("schedule", 0),
    ("admission", 1),
    ("prefix match", 2),
    ("can_admit", 2),
    ("build batch", 0),
    ("hit table", 1),
    ("forward (row writes)", 0),
    ("sampling", 0),
    ("wait + to host", 0),
    ("update", 0),
    ("publish prefix", 1),
    ("release (cache + free)", 1),
    ("stats", 0),
    ("wire encode", 0),
    ("other", 0),
    ("host total", 0),
)


class RowWritingRunner(InstantRunner):
    """A model that costs nothing but writes its req_to_token rows as ModelRunner.forward does."""

    def __init__(self, vocab: int, max_rows: int, num_kv_slots: int, max_seq_len: int, device: torch.device) -> None:
        super().__init__(vocab, max_rows, num_kv_slots)
        self.device, self.max_seq_len = device, max_seq_len
        self.logits = self.logits.to(device)
        self.req_to_token = torch.zeros(max_rows + 1, max_seq_len, dtype=torch.int32, device=device)
        self.num_prefill_steps = 0  # steps that compute a prompt token (eager, not a graph, on a GPU)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.num_prefill_steps += batch.mode is not ForwardMode.DECODE
        write_cached_prefixes(self.req_to_token, batch)
        write_new_slots(self.req_to_token, batch)
        return self.logits[: batch.logits_indices.shape[0]]


class GcClock:
    """Time in the garbage collector per generation (a full collection walks the whole heap, and
    interrupts whatever phase it lands in)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = defaultdict(float)
        self.counts: dict[int, int] = defaultdict(int)
        self._started = 0.0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self.counts[info["generation"]] += 1


@dataclass(frozen=True, slots=True)
class ChatShape:
    conversations: int  # in flight
    turns: int  # sent in all
    turns_per_conversation: int
    first_len: tuple[int, int]  # first prompt length range
    answer_len: tuple[int, int]
    new_len: tuple[int, int]  # fresh user tokens per later turn
    think_steps: int  # engine steps between an answer's end and the next turn


class ChatReplay:
    """The client side: conversations whose next prompt is the history plus the engine's answer."""

    def __init__(self, shape: ChatShape, vocab: int, seed: int = 0) -> None:
        self.shape, self.vocab = shape, vocab
        self.rng = random.Random(seed)
        self.num_sent = 0
        self._turns: dict[str, tuple[list[int], int]] = {}  # request id -> (prompt, turn number)
        self._answers: dict[str, list[int]] = defaultdict(list)
        self._due: list[tuple[int, GenerateRequest]] = []  # (step, request) not yet submitted

    def start(self) -> None:
        for _ in range(min(self.shape.conversations, self.shape.turns)):
            self._queue(self._tokens(self.shape.first_len), turn=1, step=0)

    def submit_due(self, engine: EngineCore, step: int) -> None:
        due = [request for at, request in self._due if at <= step]
        self._due = [(at, request) for at, request in self._due if at > step]
        for request in due:
            engine.add_request(request)

    def receive(self, events, step: int) -> None:
        for event in events:
            self._answers[event.request_id] += event.token_ids
            if event.finish_reason is None:
                continue
            prompt, turn = self._turns.pop(event.request_id)
            answer = self._answers.pop(event.request_id)
            if self.num_sent >= self.shape.turns:
                continue
            if turn < self.shape.turns_per_conversation:
                self._queue(prompt + answer + self._tokens(self.shape.new_len), turn + 1, step + self.shape.think_steps)
            else:
                self._queue(self._tokens(self.shape.first_len), 1, step + self.shape.think_steps)

    @property
    def is_done(self) -> bool:
        return not self._due and not self._turns

    def _queue(self, prompt: list[int], turn: int, step: int) -> None:
        request_id = f"t{self.num_sent}"
        self.num_sent += 1
        self._turns[request_id] = (prompt, turn)
        answer_len = self.rng.randint(*self.shape.answer_len)
        self._due.append((step, GenerateRequest(request_id, prompt, max_new_tokens=answer_len, ignore_eos=True)))

    def _tokens(self, length: tuple[int, int]) -> list[int]:
        return [self.rng.randrange(EOS + 1, self.vocab) for _ in range(self.rng.randint(*length))]


def build_engine(args: argparse.Namespace, prefix_caching: bool) -> EngineCore:
    max_seq_len = args.first_len[1] + args.turns_per_conversation * (args.answer_len[1] + args.new_len[1])
    runner = RowWritingRunner(args.vocab, args.max_running, args.kv_slots, max_seq_len, torch.device(args.device))
    return instant_engine(
        runner,
        args.vocab,
        max_seq_len,
        EOS,
        device=args.device,
        max_running_requests=args.max_running,
        prefix_caching=prefix_caching,
        overlap_scheduling=not args.no_overlap,
    )


def instrument(engine: EngineCore, clock: PhaseClock) -> None:
    scheduler, executor = engine.scheduler, engine.executor
    clock.wrap(scheduler, "schedule", "schedule")
    clock.wrap(scheduler, "_admit_waiting", "admission")
    clock.wrap(engine.pool, "take_cached_prefix", "prefix match")
    clock.wrap(scheduler_module, "can_admit", "can_admit")
    clock.wrap(executor.batch_builder, "build", "build batch")
    clock.wrap(batch_module, "_cached_prefix_slots", "hit table")
    clock.wrap(executor.runner, "forward", "forward (row writes)")
    clock.wrap(executor.selector, "sample", "sampling")
    clock.wrap(LaunchedStep, "result", "wait + to host")
    clock.wrap(scheduler, "update", "update")
    clock.wrap(scheduler, "_publish_prefix", "publish prefix")
    clock.wrap(scheduler, "_release", "release (cache + free)")
    clock.wrap(engine.stats, "record", "stats")


@dataclass(slots=True)
class RunTotals:
    seconds: dict[str, float]  # phase -> seconds over the run
    steps: int
    prefill_steps: int  # steps that computed a prompt token (eager on a GPU)
    turns: int
    prompt_tokens: int
    cached_tokens: int
    gc: GcClock


def run(args: argparse.Namespace, prefix_caching: bool, profiler: cProfile.Profile | None = None) -> RunTotals:
    engine = build_engine(args, prefix_caching)
    shape = ChatShape(
        args.conversations,
        args.turns,
        args.turns_per_conversation,
        tuple(args.first_len),
        tuple(args.answer_len),
        tuple(args.new_len),
        args.think_steps,
    )
    chat = ChatReplay(shape, args.vocab)
    clock = PhaseClock()
    instrument(engine, clock)
    totals: dict[str, float] = defaultdict(float)
    steps = prompt_tokens = 0
    chat.start()
    gc.collect()  # each run starts from the same heap
    try:
        with torch.inference_mode(), GcClock() as gc_clock:
            if profiler is not None:
                profiler.enable()
            while not chat.is_done:
                chat.submit_due(engine, steps)
                started = time.perf_counter()
                events = engine.step()
                encoded = time.perf_counter()
                encoder.encode(StepOutputs(events))  # the engine process sends every step's events
                totals["wire encode"] += time.perf_counter() - encoded
                totals["host total"] += time.perf_counter() - started
                for phase, seconds in clock.take().items():
                    totals[phase] += seconds
                chat.receive(events, steps)
                steps += 1
                prompt_tokens += sum(e.num_prompt_tokens or 0 for e in events)
            if profiler is not None:
                profiler.disable()
    finally:
        clock.unwrap()
    totals["other"] = totals["host total"] - sum(totals[phase] for phase, depth in PHASES[:-2] if depth == 0)
    assert engine.pool.is_full_free()
    runner = engine.executor.runner
    assert isinstance(runner, RowWritingRunner)
    return RunTotals(
        dict(totals),
        steps,
        runner.num_prefill_steps,
        chat.num_sent,
        prompt_tokens,
        engine.pool.num_prefix_hit_tokens,
        gc_clock,
    )


def report(args: argparse.Namespace, on: RunTotals, off: RunTotals) -> None:
    print(
        f"\n{args.conversations} conversations in flight, {on.turns} turns, device {args.device}, "
        f"overlap {'off' if args.no_overlap else 'on'}"
    )
    print("| phase | on ms/step | off ms/step | on us/turn | off us/turn | on - off, us/turn |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase, depth in PHASES:
        name = "&nbsp;" * 4 * depth + phase
        a, b = on.seconds.get(phase, 0.0), off.seconds.get(phase, 0.0)
        print(
            f"| {name} | {1e3 * a / on.steps:.3f} | {1e3 * b / off.steps:.3f} | {1e6 * a / on.turns:.0f} "
            f"| {1e6 * b / off.turns:.0f} | {1e6 * (a / on.turns - b / off.turns):+.0f} |"
        )
    for label, get in (
        ("steps", lambda t: t.steps),
        ("steps with a prefill", lambda t: t.prefill_steps),
        ("prompt tokens", lambda t: t.prompt_tokens),
        ("of which cached", lambda t: t.cached_tokens),
    ):
        print(f"| {label} | {get(on)} | {get(off)} | | | |")
    for generation in range(3):
        counts = [t.gc.counts.get(generation, 0) for t in (on, off)]
        ms = [1e3 * t.gc.seconds.get(generation, 0.0) for t in (on, off)]
        print(
            f"| gc generation {generation}: collections (ms in all) | {counts[0]} ({ms[0]:.1f}) | {counts[1]} ({ms[1]:.1f}) | | | |"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--turns", type=int, default=768)
    parser.add_argument("--turns-per-conversation", type=int, default=6)
    parser.add_argument("--first-len", type=int, nargs=2, default=[60, 240])
    parser.add_argument("--answer-len", type=int, nargs=2, default=[32, 128])
    parser.add_argument("--new-len", type=int, nargs=2, default=[40, 74])
    parser.add_argument("--think-steps", type=int, default=2)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--kv-slots", type=int, default=400_000)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (a busy machine's second one only spins)"
    )
    parser.add_argument("--cprofile", action="store_true", help="print the cache-on run's top functions")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    profiler = cProfile.Profile() if args.cprofile else None
    on = run(args, prefix_caching=True, profiler=profiler)
    off = run(args, prefix_caching=False)
    report(args, on, off)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
