"""Grammar-constrained decoding: settles issue 15's two GPU targets in one run (not CI; no HTTP).

    python3 -m benchmarks.random_model /tmp/model --preset llama3-8b --device cuda
    python3 scripts/device/bench_grammar.py /tmp/model                # must finish within 5 min on one H100
    python3 scripts/device/bench_grammar.py MODEL --mask-only --device cpu    # the CPU figure in BENCHMARKS.md

MODEL is a model folder with its tokenizer (the random Llama-3-8B has Llama-3's, so the masks cover the real
128k vocabulary). Needs xgrammar on the device. Prints one JSON line per stage and writes them all to
$OUT/grammar_bench.json; the last line says whether each target is met.

1. Mask cost. A pool of matchers of SCHEMA, each advanced every step by a random token its grammar allows
   (the schema compiled as the engine compiles it). Per step, after a warm-up, every configuration fills the
   same matcher states, in a shuffled order:
   - the fill sweep: threads x rows (THREAD_COUNTS x ROW_COUNTS), xgrammar's batched fill on the host;
     `fill_ms[rows][threads]` medians, and `fastest_threads` per row count, from which
     tgi_compat.router.grammar.SINGLE_THREAD_FILL_ROWS is set (`single_thread_fastest_up_to_rows`);
   - the engine's own path at `--rows`, each part timed to a device sync: GrammarBackend.mask (the fill, on
     tgi_compat.router.grammar.fill_threads(rows) threads, right after the host waited ~8 ms on a stand-in forward, as
     in the engine), GrammarMask.apply (after the penalties; it reads the `mask_mb` of pinned host memory in
     place) and GrammarMask.confine (after the warpers); `mask_ms_per_step` = the sum of their three
     medians. Target at 64 rows: <= 1 ms. `*_host_ms`:
     the host's share of a part (its call returning, before the sync); `*_device_ms` on a GPU: its device
     time (CUDA events around it, queued behind a forward, in the exposed-cost pass below).
   - fill_after_idle_ms: the fill of `--rows` rows on each thread count right after a stand-in forward's sync,
     i.e. with the host idle for ~8 ms as in the engine (the sweep's fills run back to back); its fastest
     thread count is the one tgi_compat.router.grammar.fill_threads should pick at that size.
   - kernels_match_reference: apply + confine on the device equal the torch reference (CPU) on these masks.
   On a GPU also the exposed cost: what the mask adds to a step whose stand-in forward (~8 ms of matmuls,
   about a 64-row Llama-3-8B decode step) is queued first, as the executor queues it before it fills.
2. Throughput. An engine process behind tgi_compat.router.client.ZmqEngineClient (the server's own client); `rows`
   requests of PROMPT_LEN random ids x `new_tokens` at once, unconstrained vs constrained by SCHEMA, whose
   array of people is long enough that no answer completes first (both loads generate every token). A
   warm-up of both loads, then `reps` pairs (plain, constrained) interleaved; output tok/s counts the tokens
   that reached the client. Each pair's ratio, and the median ratio: target >= 0.85. Overlap scheduling on,
   constrained steps' masks filled while their forward runs: the real engine path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tgi_compat.router.request import GenerateRequest, GrammarKind, GrammarSpec

PROMPT_LEN = 128
THREAD_COUNTS = (1, 2, 4, 8)
ROW_COUNTS = (16, 32, 64, 128, 256)
MASK_TARGET_MS = 1.0
RATIO_TARGET = 0.85
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": "string", "pattern": "[a-z]{1,8}@[a-z]{1,8}\\.com"},
    },
    "required": ["name", "age", "role", "email"],
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 1000}},
    "required": ["people"],
}
SPEC = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))


def mask_cost(model_dir: str, rows: int, device: str, steps: int, warmup: int = 10) -> dict:
    import torch
    import xgrammar

    from tgi_compat.modeling.source import resolve_model_source
    from tgi_compat.modeling.tokenizer import load_tokenizer
    from tgi_compat.modeling.weights.loader import load_model_config
    from tgi_compat.router.grammar import GrammarBackend, GrammarCompiler, fill_threads
    from tgi_compat.router.grammar_compile import CompileLimits

    vocab = load_model_config(resolve_model_source(model_dir)).vocab_size
    tokenizer = load_tokenizer(model_dir)
    limits = CompileLimits(timeout_s=600.0, cache_bytes=2**33)
    compiler = GrammarCompiler(lambda: tokenizer, vocab, [tokenizer.eos_token_id], limits)
    backend = GrammarBackend(compiler, torch.device(device))
    started = time.perf_counter()
    compiled = compiler.compile(SPEC)  # the first: with the tokenizer scan and the compile process's start
    compile_s = time.perf_counter() - started
    row_counts = sorted({*ROW_COUNTS, rows})
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(max(row_counts))]

    class Row:  # what GrammarBackend.mask reads of a Request
        def __init__(self, matcher) -> None:
            self.matcher = matcher
            self.grammar_terminated = False  # the schema's array of people is never complete here

    requests = [Row(m) for m in matchers[:rows]]
    batch_matchers = {t: xgrammar.BatchGrammarMatcher(max_threads=t) for t in THREAD_COUNTS}
    sweep_bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab)
    logits = torch.randn(rows, vocab, device=device)
    rng = random.Random(0)
    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    forward = _stand_in_forward(device) if on_gpu else (lambda: None)
    kernels_match = _kernels_match_reference(backend, requests, logits, Row)

    fill_ms: dict[tuple[int, int], list[float]] = {(n, t): [] for n in row_counts for t in THREAD_COUNTS}
    idle_fill_ms: dict[int, list[float]] = {t: [] for t in THREAD_COUNTS}
    parts = ("fill", "apply", "confine")
    extra = ("apply_host", "confine_host", "apply_device", "confine_device")
    engine: dict[str, list[float]] = {key: [] for key in (*parts, *extra)}
    engine |= {"forward": [], "step": [], "busy_launch_host": []}

    def engine_path() -> None:
        sync()
        t0 = time.perf_counter()
        forward()
        scores = logits.clone()
        sync()
        t1 = time.perf_counter()  # the host was idle for the forward, as it is in the engine before a fill
        mask = backend.mask(requests)
        t2 = time.perf_counter()
        mask.apply(scores)
        t2_host = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        mask.confine(scores)
        t3_host = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        forward()  # the engine's order: forward queued, then the host fills while the GPU runs it
        scores = logits.clone()
        mask = backend.mask(requests)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if on_gpu else []

        def mark(i: int) -> None:
            if marks:
                marks[i].record()

        mark(0)  # queued behind the forward: the differences are the parts' device times, no launch gaps
        t_launch = time.perf_counter()
        mask.apply(scores)
        mark(1)
        mask.confine(scores)
        mark(2)
        engine["busy_launch_host"].append(1e3 * (time.perf_counter() - t_launch))
        sync()
        t5 = time.perf_counter()
        timings = dict(fill=t2 - t1, apply=t3 - t2, confine=t4 - t3, forward=t1 - t0, step=t5 - t4)
        timings |= dict(apply_host=t2_host - t2, confine_host=t3_host - t3)
        for key, value in timings.items():
            engine[key].append(1e3 * value)
        for i, key in enumerate(("apply_device", "confine_device") if marks else ()):
            engine[key].append(marks[i].elapsed_time(marks[i + 1]))  # in ms

    def fill_after_idle(threads: int) -> None:
        forward()
        sync()
        t = time.perf_counter()
        batch_matchers[threads].batch_fill_next_token_bitmask(matchers[:rows], sweep_bitmask)
        idle_fill_ms[threads].append(1e3 * (time.perf_counter() - t))

    for step in range(warmup + steps):
        runs: list = [*fill_ms, *(("idle", t) for t in THREAD_COUNTS), "engine"]
        rng.shuffle(runs)  # no configuration always runs first (cold caches) or last
        for run in runs:
            if run == "engine":
                engine_path()
                continue
            if run[0] == "idle":
                fill_after_idle(run[1])
                continue
            num_rows, threads = run
            t = time.perf_counter()
            batch_matchers[threads].batch_fill_next_token_bitmask(matchers[:num_rows], sweep_bitmask)
            fill_ms[run].append(1e3 * (time.perf_counter() - t))
        if step == warmup - 1:  # drop the warm-up
            for values in (*fill_ms.values(), *idle_fill_ms.values(), *engine.values()):
                values.clear()
        batch_matchers[1].batch_fill_next_token_bitmask(matchers, sweep_bitmask)
        _advance_randomly(matchers, sweep_bitmask, vocab, rng)

    median = statistics.median
    fill = {n: {t: median(fill_ms[n, t]) for t in THREAD_COUNTS} for n in row_counts}
    fastest = {n: min(by_threads, key=by_threads.get) for n, by_threads in fill.items()}
    single_up_to = 0
    for n in row_counts:  # one thread within 5% of the fastest, from the smallest batch up
        if fill[n][1] > 1.05 * fill[n][fastest[n]]:
            break
        single_up_to = n
    part_ms = {key: median(engine[key]) for key in parts}
    mask_ms = sum(part_ms.values())
    idle_fill = {t: median(values) for t, values in idle_fill_ms.items()}
    # Exposed: what the grammar adds to a step whose forward is queued first (on a CPU nothing is hidden).
    exposed = median(engine["step"]) - median(engine["forward"]) if on_gpu else mask_ms
    result = dict(
        stage="mask",
        device=device,
        rows=rows,
        vocab=vocab,
        timed_steps=steps,
        compile_ms=1e3 * compile_s,
        engine_fill_threads=fill_threads(rows),
        engine_fill_ms=part_ms["fill"],
        engine_fill_ms_mean=statistics.mean(engine["fill"]),  # bimodal: a few grammar states are expensive
        mask_mb=4 * rows * ((vocab + 31) // 32) / 1e6,  # the bitmask words apply reads from the host
        apply_ms=part_ms["apply"],
        confine_ms=part_ms["confine"],
        # the host's share of a part (its call returning), and on a GPU its device time (CUDA events)
        **{f"{key}_ms": median(engine[key]) if engine[key] else None for key in extra},
        mask_ms_per_step=mask_ms,
        # the host's time for apply + confine (with the event records) while the GPU runs a forward, as in
        # the engine; against apply_host + confine_host, each timed right after a sync
        busy_launch_host_ms=median(engine["busy_launch_host"]),
        kernels_match_reference=kernels_match,
        mask_us_per_token=1e3 * mask_ms / rows,
        mask_target_met=mask_ms <= MASK_TARGET_MS,
        stand_in_forward_ms=median(engine["forward"]) if on_gpu else None,
        exposed_mask_ms_per_step=exposed,
        fill_after_idle_ms=idle_fill,  # at `rows` rows, by threads
        fastest_threads_after_idle=min(idle_fill, key=idle_fill.get),
        fill_ms=fill,  # median per step, by rows then threads
        fill_ms_mean={n: {t: statistics.mean(fill_ms[n, t]) for t in THREAD_COUNTS} for n in row_counts},
        fastest_threads=fastest,
        single_thread_fastest_up_to_rows=single_up_to,  # -> tgi_compat.router.grammar.SINGLE_THREAD_FILL_ROWS
    )
    print(json.dumps(result), flush=True)
    return result


def _kernels_match_reference(backend, requests: list, logits, row_type) -> bool:
    """GrammarMask.apply then .confine on the device (the Triton kernels on a GPU) give the torch reference's
    scores, every row constrained and every third one not (a row index), with NaN and +inf among the scores."""
    import torch

    from tgi_compat.kernels.grammar_apply import grammar_apply_ref
    from tgi_compat.kernels.grammar_confine import grammar_confine_ref

    scores = logits.clone()
    scores[0, ::5], scores[1, 7], scores[2] = float("nan"), float("inf"), float("-inf")
    matches = []
    for batch in (requests, [row_type(None) if i % 3 == 0 else r for i, r in enumerate(requests)]):
        mask = backend.mask(batch)
        expected = grammar_apply_ref(scores.to("cpu", copy=True), mask.bitmask, mask.row_index)
        expected = grammar_confine_ref(expected, mask.bitmask, mask.row_index)
        got = mask.confine(mask.apply(scores.clone())).cpu()
        matches.append(
            torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
        )
    return all(matches)


def _advance_randomly(matchers, bitmask, vocab: int, rng: random.Random) -> None:
    """Each matcher accepts a random token its filled bitmask row allows."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    for i, matcher in enumerate(matchers):
        allowed = np.flatnonzero(bits[i])
        assert matcher.accept_token(int(allowed[rng.randrange(len(allowed))]))


def _stand_in_forward(device: str, target_ms: float = 8.0):
    """GPU work of about `target_ms` (a chain of matmuls), queued asynchronously like a model forward."""
    import torch

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


async def throughput(model_dir: str, rows: int, new_tokens: int, reps: int) -> list[dict]:
    from tgi_compat.router.client import ZmqEngineClient
    from tgi_compat.router.config import EngineConfig

    client = await ZmqEngineClient.start(EngineConfig(model_id=model_dir))
    rng, ids, results = random.Random(0), iter(range(10**9)), []

    async def one(
        prompt: list[int], grammar: GrammarSpec | None, max_new: int, start: float
    ) -> tuple[int, list[float]]:
        """The request's tokens, and the times (s from the load's start) its token batches arrived."""
        request = GenerateRequest(f"g{next(ids)}", prompt, max_new_tokens=max_new, ignore_eos=True, grammar=grammar)
        tokens, arrivals = 0, []
        async for batch in client.generate_batches(request):
            tokens += sum(len(e.token_ids) for e in batch)
            arrivals.append(time.perf_counter() - start)
            if batch[-1].error:
                raise RuntimeError(batch[-1].error)
        return tokens, arrivals

    async def load(constrained: bool, max_new: int) -> tuple[int, float, dict]:
        # fresh random prompts each load: no prefix-cache hit favours the second load of a pair
        top = min(100_000, client.info.vocab_size)
        prompts = [[rng.randrange(1000, top) for _ in range(PROMPT_LEN)] for _ in range(rows)]
        start = time.perf_counter()
        done = await asyncio.gather(*(one(p, SPEC if constrained else None, max_new, start) for p in prompts))
        return sum(n for n, _ in done), time.perf_counter() - start, _arrival_stats([a for _, a in done])

    try:
        for constrained in (False, True):  # warm-up: the grammar compiled and cached, every batch shape seen
            await load(constrained, 32)
        for rep in range(reps):
            plain_tok_s = 0.0
            for constrained in (False, True):
                tokens, seconds, arrivals = await load(constrained, new_tokens)
                result = dict(stage="throughput", rep=rep, constrained=constrained, rows=rows, tokens=tokens)
                result["ended_at"] = time.time()  # wall clock: lines the engine logged meanwhile can be placed
                result |= dict(seconds=seconds, tok_s=tokens / seconds, **arrivals)
                if constrained:
                    result["ratio"] = result["tok_s"] / plain_tok_s
                else:
                    plain_tok_s = result["tok_s"]
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        await client.shutdown()
    plain = statistics.median(r["tok_s"] for r in results if not r["constrained"])
    constrained = statistics.median(r["tok_s"] for r in results if r["constrained"])
    ratio = statistics.median(r["ratio"] for r in results if "ratio" in r)
    summary = dict(
        stage="throughput_summary",
        reps=reps,
        plain_tok_s_median=plain,
        constrained_tok_s_median=constrained,
        ratios=[r["ratio"] for r in results if "ratio" in r],
        ratio_median=ratio,
        ratio_target_met=ratio >= RATIO_TARGET,
        # what the grammar adds to a step end to end (the fill not hidden behind the forward, apply,
        # confine, the deferred sampling's launch gap): the constrained load's step time minus the plain one's
        exposed_grammar_ms_per_step=1e3 * rows * (1 / constrained - 1 / plain),
    )
    print(json.dumps(summary), flush=True)
    return [*results, summary]


def _arrival_stats(arrivals: list[list[float]]) -> dict:
    """Where a load's time went, from each request's token-batch arrival times: a late start (first token),
    stalls (the longest gaps between a request's batches) or every step slower (the median gap)."""
    firsts = [a[0] for a in arrivals if a]
    gaps = sorted(later - earlier for a in arrivals for earlier, later in zip(a, a[1:]))
    if not gaps:
        return {}
    return dict(
        first_token_s_median=statistics.median(firsts),
        first_token_s_max=max(firsts),
        last_token_s=max(a[-1] for a in arrivals if a),
        gap_ms_median=1e3 * statistics.median(gaps),
        gap_ms_p99=1e3 * gaps[int(0.99 * (len(gaps) - 1))],
        gap_ms_max=1e3 * gaps[-1],
        gaps_over_50ms=sum(g > 0.05 for g in gaps),
    )


def _print_table(mask: dict) -> None:
    """The mask's parts at `rows` rows, for a reader of the log (the JSON above has every figure)."""
    print(f"\nmask cost per step at {mask['rows']} rows ({mask['device']}), medians in ms:")
    for part in ("engine_fill", "apply", "confine"):
        shares = [f"{kind} {mask[key]:.3f}" for kind in ("host", "device") if mask.get(key := f"{part}_{kind}_ms")]
        print(f"  {part:<12} {mask[f'{part}_ms']:7.3f}" + (f"   ({', '.join(shares)})" if shares else ""))
    print(f"  {'total':<12} {mask['mask_ms_per_step']:7.3f}   target <= {MASK_TARGET_MS}")
    print(f"  apply + confine host time while the GPU is busy: {mask['busy_launch_host_ms']:.3f}")
    print(f"  apply + confine match the torch reference: {mask['kernels_match_reference']}")
    idle = "  ".join(f"{t}: {ms:.3f}" for t, ms in mask["fill_after_idle_ms"].items())
    print(f"  fill after idle by threads: {idle}   (the engine fills on {mask['engine_fill_threads']})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?", default="/tmp/model")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3, help="plain/constrained pairs, interleaved")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mask-only", action="store_true")
    parser.add_argument("--mask-steps", type=int, default=60, help="timed steps of every fill configuration")
    args = parser.parse_args()
    started = time.perf_counter()
    results = [mask_cost(args.model_dir, args.rows, args.device, args.mask_steps)]
    verdict = dict(stage="targets", mask_ms_per_step=results[0]["mask_ms_per_step"], mask_target_ms=MASK_TARGET_MS)
    if not args.mask_only:
        results += asyncio.run(throughput(args.model_dir, args.rows, args.new_tokens, args.reps))
        verdict |= dict(ratio_median=results[-1]["ratio_median"], ratio_target=RATIO_TARGET)
        verdict["ratio_target_met"] = results[-1]["ratio_target_met"]
    verdict |= dict(mask_target_met=results[0]["mask_target_met"], seconds=time.perf_counter() - started)
    verdict["kernels_match_reference"] = results[0]["kernels_match_reference"]
    print(json.dumps(verdict), flush=True)
    results.append(verdict)
    _print_table(results[0])
    with open(os.path.join(os.environ.get("OUT", "."), "grammar_bench.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
