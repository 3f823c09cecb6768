"""Part 1 of benchmarks.device.grammar: what a grammar mask costs a decode step (see its docstring).

A pool of matchers of the schema, each advanced every step by a random token its grammar allows. Per step,
after a warm-up, every configuration fills the same matcher states, in a shuffled order: the fill sweep
(threads x rows, xgrammar's batched fill on the host), the fill right after a stand-in forward (the host idle
as in the engine), and the engine's own path at `rows` (GrammarBackend.mask, SamplingKernels.apply_grammar, .confine_grammar,
each timed to a device sync, then again queued behind a forward for the exposed cost and device times).
"""

from __future__ import annotations

import json
import random
import statistics
import time

import numpy as np
import torch

from tgi_compat.router.request import GrammarSpec

THREAD_COUNTS = (1, 2, 4, 8)
ROW_COUNTS = (16, 32, 64, 128, 256)
MASK_TARGET_MS = 1.0
PARTS = ("fill", "apply", "confine")
HOST_AND_DEVICE = ("apply_host", "confine_host", "apply_device", "confine_device")


class Row:
    """What GrammarBackend.mask reads of a Request."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.grammar_terminated = False  # the schema's array of people is never complete here


class MaskBench:
    def __init__(self, model_dir: str, spec: GrammarSpec, rows: int, device: str):
        import xgrammar

        from tgi_compat.modeling.source import resolve_model_source
        from tgi_compat.modeling.tokenizer import load_tokenizer
        from tgi_compat.modeling.weights.loader import load_model_config
        from tgi_compat.router.sampling.grammar import GrammarBackend, GrammarCompiler
        from tgi_compat.router.sampling.grammar_compile import CompileLimits
        from tgi_compat.router.sampling.sampler import SamplingKernels

        self.vocab = load_model_config(resolve_model_source(model_dir)).vocab_size
        tokenizer = load_tokenizer(model_dir)
        limits = CompileLimits(timeout_s=600.0, cache_bytes=2**33)  # a benchmark's grammar is never refused
        self.compiler = GrammarCompiler(lambda: tokenizer, self.vocab, [tokenizer.eos_token_id], limits)
        self.backend = GrammarBackend(self.compiler, torch.device(device))
        self.kernels = SamplingKernels.for_device(torch.device(device))
        started = time.perf_counter()
        compiled = self.compiler.compile(spec)  # the first: with the tokenizer scan and the compile process's start
        self.compile_s = time.perf_counter() - started
        self.rows, self.device, self.on_gpu = rows, device, device.startswith("cuda")
        self.row_counts = sorted({*ROW_COUNTS, rows})
        self.matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(max(self.row_counts))]
        self.requests = [Row(m) for m in self.matchers[:rows]]
        self.batch_matchers = {t: xgrammar.BatchGrammarMatcher(max_threads=t) for t in THREAD_COUNTS}
        self.bitmask = xgrammar.allocate_token_bitmask(len(self.matchers), self.vocab)
        self.logits = torch.randn(rows, self.vocab, device=device)
        self.forward = stand_in_forward(device) if self.on_gpu else (lambda: None)
        self.fill_ms = {(n, t): [] for n in self.row_counts for t in THREAD_COUNTS}
        self.idle_fill_ms: dict[int, list[float]] = {t: [] for t in THREAD_COUNTS}
        self.engine: dict[str, list[float]] = {key: [] for key in (*PARTS, *HOST_AND_DEVICE)}
        self.engine |= {"forward": [], "step": [], "busy_launch_host": []}

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()

    def fill(self, rows: int, threads: int) -> float:
        t = time.perf_counter()
        self.batch_matchers[threads].batch_fill_next_token_bitmask(self.matchers[:rows], self.bitmask)
        return 1e3 * (time.perf_counter() - t)

    def fill_after_idle(self, threads: int) -> None:
        self.forward()
        self.sync()
        self.idle_fill_ms[threads].append(self.fill(self.rows, threads))

    def engine_path(self) -> None:
        """Each part timed to a sync right after a stand-in forward, then the parts queued behind one."""
        self.sync()
        t0 = time.perf_counter()
        self.forward()
        scores = self.logits.clone()
        self.sync()
        t1 = time.perf_counter()  # the host was idle for the forward, as it is in the engine before a fill
        mask = self.backend.mask(self.requests)
        t2 = time.perf_counter()
        self.kernels.apply_grammar(scores, mask)
        t2_host = time.perf_counter()
        self.sync()
        t3 = time.perf_counter()
        self.kernels.confine_grammar(scores, mask)
        t3_host = time.perf_counter()
        self.sync()
        t4 = time.perf_counter()
        timings = dict(fill=t2 - t1, apply=t3 - t2, confine=t4 - t3, forward=t1 - t0)
        timings |= dict(apply_host=t2_host - t2, confine_host=t3_host - t3, step=self.queued_step())
        for key, value in timings.items():
            self.engine[key].append(1e3 * value)

    def queued_step(self) -> float:
        """The engine's order: forward queued, then the host fills while the GPU runs it. Seconds, start to sync."""
        t4 = time.perf_counter()
        self.forward()
        scores = self.logits.clone()
        mask = self.backend.mask(self.requests)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.on_gpu else []
        for mark in marks[:1]:
            mark.record()  # queued behind the forward: the differences are the parts' device times
        t_launch = time.perf_counter()
        self.kernels.apply_grammar(scores, mask)
        for mark in marks[1:2]:
            mark.record()
        self.kernels.confine_grammar(scores, mask)
        for mark in marks[2:]:
            mark.record()
        self.engine["busy_launch_host"].append(1e3 * (time.perf_counter() - t_launch))
        self.sync()
        seconds = time.perf_counter() - t4
        for i, key in enumerate(("apply_device", "confine_device") if marks else ()):
            self.engine[key].append(marks[i].elapsed_time(marks[i + 1]))  # in ms
        return seconds

    def run(self, steps: int, warmup: int) -> None:
        rng = random.Random(0)
        for step in range(warmup + steps):
            runs: list = [*self.fill_ms, *(("idle", t) for t in THREAD_COUNTS), "engine"]
            rng.shuffle(runs)  # no configuration always runs first (cold caches) or last
            for run in runs:
                if run == "engine":
                    self.engine_path()
                elif run[0] == "idle":
                    self.fill_after_idle(run[1])
                else:
                    self.fill_ms[run].append(self.fill(*run))
            if step == warmup - 1:  # drop the warm-up
                for values in (*self.fill_ms.values(), *self.idle_fill_ms.values(), *self.engine.values()):
                    values.clear()
            self.batch_matchers[1].batch_fill_next_token_bitmask(self.matchers, self.bitmask)
            advance_randomly(self.matchers, self.bitmask, self.vocab, rng)


def mask_cost(model_dir: str, spec: GrammarSpec, rows: int, device: str, steps: int, warmup: int = 10) -> dict:
    from tgi_compat.router.sampling.grammar import fill_threads

    bench = MaskBench(model_dir, spec, rows, device)
    kernels_match = kernels_match_reference(bench.backend, bench.kernels, bench.requests, bench.logits)
    bench.run(steps, warmup)
    median, engine = statistics.median, bench.engine
    fill = {n: {t: median(bench.fill_ms[n, t]) for t in THREAD_COUNTS} for n in bench.row_counts}
    fastest = {n: min(by_threads, key=by_threads.get) for n, by_threads in fill.items()}
    single_up_to = 0
    for n in bench.row_counts:  # one thread within 5% of the fastest, from the smallest batch up
        if fill[n][1] > 1.05 * fill[n][fastest[n]]:
            break
        single_up_to = n
    part_ms = {key: median(engine[key]) for key in PARTS}
    mask_ms = sum(part_ms.values())
    idle_fill = {t: median(values) for t, values in bench.idle_fill_ms.items()}
    # Exposed: what the grammar adds to a step whose forward is queued first (on a CPU nothing is hidden).
    exposed = median(engine["step"]) - median(engine["forward"]) if bench.on_gpu else mask_ms
    result = dict(stage="mask", device=device, rows=rows, vocab=bench.vocab, timed_steps=steps)
    result |= dict(compile_ms=1e3 * bench.compile_s, engine_fill_threads=fill_threads(rows))
    result |= dict(engine_fill_ms=part_ms["fill"], engine_fill_ms_mean=statistics.mean(engine["fill"]))
    result |= dict(
        mask_mb=4 * rows * ((bench.vocab + 31) // 32) / 1e6,  # the bitmask words apply reads from the host
        apply_ms=part_ms["apply"],
        confine_ms=part_ms["confine"],
        # the host's share of a part (its call returning), and on a GPU its device time (CUDA events)
        **{f"{key}_ms": median(engine[key]) if engine[key] else None for key in HOST_AND_DEVICE},
        mask_ms_per_step=mask_ms,
        # the host's time for apply + confine while the GPU runs a forward, as in the engine
        busy_launch_host_ms=median(engine["busy_launch_host"]),
        kernels_match_reference=kernels_match,
        mask_us_per_token=1e3 * mask_ms / rows,
        mask_target_met=mask_ms <= MASK_TARGET_MS,
        stand_in_forward_ms=median(engine["forward"]) if bench.on_gpu else None,
        exposed_mask_ms_per_step=exposed,
        fill_after_idle_ms=idle_fill,  # at `rows` rows, by threads
        fastest_threads_after_idle=min(idle_fill, key=idle_fill.get),
        fill_ms=fill,  # median per step, by rows then threads
        fill_ms_mean={n: {t: statistics.mean(bench.fill_ms[n, t]) for t in THREAD_COUNTS} for n in bench.row_counts},
        fastest_threads=fastest,
        single_thread_fastest_up_to_rows=single_up_to,  # -> tgi_compat.router.sampling.grammar.SINGLE_THREAD_FILL_ROWS
    )
    print(json.dumps(result), flush=True)
    return result


def kernels_match_reference(backend, kernels, requests: list, logits: torch.Tensor) -> bool:
    """SamplingKernels.apply_grammar then .confine_grammar on the device (the Triton kernels on a GPU) give the torch reference's
    scores, every row constrained and every third one not (a row index), with NaN and +inf among the scores."""
    from tgi_compat.kernels.sampling.grammar_apply import grammar_apply_ref
    from tgi_compat.kernels.sampling.grammar_confine import grammar_confine_ref

    scores = logits.clone()
    scores[0, ::5], scores[1, 7], scores[2] = float("nan"), float("inf"), float("-inf")
    matches = []
    for batch in (requests, [Row(None) if i % 3 == 0 else r for i, r in enumerate(requests)]):
        mask = backend.mask(batch)
        expected = grammar_apply_ref(scores.to("cpu", copy=True), mask.bitmask, mask.row_index)
        expected = grammar_confine_ref(expected, mask.bitmask, mask.row_index)
        got = kernels.confine_grammar(kernels.apply_grammar(scores.clone(), mask), mask).cpu()
        matches.append(
            torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
        )
    return all(matches)


def advance_randomly(matchers, bitmask, vocab: int, rng: random.Random) -> None:
    """Each matcher accepts a random token its filled bitmask row allows."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    for i, matcher in enumerate(matchers):
        allowed = np.flatnonzero(bits[i])
        assert matcher.accept_token(int(allowed[rng.randrange(len(allowed))]))


def stand_in_forward(device: str, target_ms: float = 8.0):
    """GPU work of about `target_ms` (a chain of matmuls), queued asynchronously like a model forward."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(5):  # cuBLAS picks its kernel on the first calls: not part of the calibration
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    repeats = max(1, round(target_ms / (1e3 * (time.perf_counter() - t) / 20)))

    def forward() -> None:
        for _ in range(repeats):
            a @ a

    return forward
