"""Grammar-constrained decoding: the per-step mask cost and the engine's throughput (not CI; no HTTP).

    python3 scripts/device/bench_grammar.py [MODEL_DIR] [--rows 64] [--new-tokens 256]
    python3 scripts/device/bench_grammar.py MODEL --mask-only --device cpu     # the CPU number in BENCHMARKS.md

MODEL_DIR is serve_bench.sh's random Llama-3-8B (`STAGES=model bash scripts/device/serve_bench.sh`; its
tokenizer is Llama-3's, so the vocabulary the masks cover is the real one). Needs xgrammar on the device.

1. Mask cost (router.grammar.GrammarBackend, as the engine uses it): `rows` matchers of SCHEMA, each
   advanced by tokens its grammar allows (the schema compiled as the engine compiles it, its bounded
   repetitions folded; `fill_*_folded_vs_unfolded` compares with xgrammar's own conversion on the same
   tokens); per step, filling every row's bitmask on the host and copying
   it to the device (`mask`), then applying it to a [rows, vocab] float32 logits tensor (`apply`).
   Reported as ms per step and us per token (row), the fill at other thread counts at the same states
   (`fill_ms_by_threads`), and on a GPU the exposed cost: the time the mask adds to a step whose
   stand-in forward (~8 ms of matmuls, about a 64-row decode step of Llama-3-8B) is queued first, as
   the executor queues the forward before it fills (`exposed_mask_ms_per_step`).
2. Throughput: an engine process behind router.client.ZmqEngineClient (the server's own client); `rows`
   requests of PROMPT_LEN random ids x `new_tokens` at once, unconstrained vs constrained by SCHEMA, whose
   array of people is long enough that no answer completes first (every request runs all its tokens, so
   the two loads do the same work). Interleaved twice; output tok/s counts tokens that reached the client.
   This is the real engine path: overlap scheduling on, constrained steps' masks filled while their forward
   runs. `exposed_grammar_ms_per_step` = rows x (1/constrained - 1/plain tok/s): what the grammar adds to a
   64-row step end to end.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from router.request import GenerateRequest, GrammarKind, GrammarSpec

PROMPT_LEN = 128
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


def mask_cost(model_dir: str, rows: int, device: str, steps: int = 200, forward_ms: float = 8.0) -> dict:
    import torch
    import xgrammar

    from modeling.source import resolve_model_source
    from modeling.tokenizer import load_tokenizer
    from modeling.weights.loader import load_model_config
    from router.grammar import FILL_THREADS, GrammarBackend, GrammarCompiler

    source = resolve_model_source(model_dir)
    vocab = load_model_config(source).vocab_size
    tokenizer = load_tokenizer(model_dir)
    compiler = GrammarCompiler(lambda: tokenizer, vocab, [tokenizer.eos_token_id])
    backend = GrammarBackend(compiler, torch.device(device))
    started = time.perf_counter()
    compiler.compile(SPEC)
    compile_s = time.perf_counter() - started

    class Row:  # what GrammarBackend.mask reads of a Request
        def __init__(self) -> None:
            self.matcher = compiler.compile(SPEC)

    requests = [Row() for _ in range(rows)]
    logits = torch.randn(rows, vocab, device=device)
    rng = random.Random(0)
    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    forward = _stand_in_forward(device, forward_ms) if on_gpu else (lambda: None)
    # The fill with other thread counts, at the same matcher states (the engine's count is FILL_THREADS).
    sweep = {n: xgrammar.BatchGrammarMatcher(max_threads=n) for n in sorted({1, 2, 4, 8, 16, FILL_THREADS})}
    sweep_bitmask = xgrammar.allocate_token_bitmask(rows, vocab)
    # The same rows on xgrammar's own conversion of the schema (before router/grammar_ebnf.py's folding),
    # advanced by the same tokens (the folded grammar accepts exactly the same strings).
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    unfolded = xgrammar.GrammarCompiler(info).compile_json_schema(SPEC.value, any_whitespace=False, strict_mode=True)
    unfolded_matchers = [xgrammar.GrammarMatcher(unfolded) for _ in range(rows)]
    fill_ms, apply_ms, step_ms, forward_only_ms, unfolded_ms = [], [], [], [], []
    sweep_ms: dict[int, list[float]] = {n: [] for n in sweep}
    for step in range(steps):
        for threads, batch_matcher in sweep.items():
            t = time.perf_counter()
            batch_matcher.batch_fill_next_token_bitmask([r.matcher for r in requests], sweep_bitmask)
            sweep_ms[threads].append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        sweep[FILL_THREADS].batch_fill_next_token_bitmask(unfolded_matchers, sweep_bitmask)
        unfolded_ms.append(1e3 * (time.perf_counter() - t))
        sync()
        t0 = time.perf_counter()
        forward()
        sync()
        t1 = time.perf_counter()
        mask = backend.mask(requests)
        sync()
        t2 = time.perf_counter()
        scores = mask.apply(logits.clone())
        sync()
        t3 = time.perf_counter()
        forward()  # the engine's order: forward queued, then the host fills while the GPU runs it
        mask = backend.mask(requests)
        scores = mask.apply(logits.clone())
        sync()
        t4 = time.perf_counter()
        if step >= 10:  # warm-up
            forward_only_ms.append(1e3 * (t1 - t0))
            fill_ms.append(1e3 * (t2 - t1))
            apply_ms.append(1e3 * (t3 - t2))
            step_ms.append(1e3 * (t4 - t3))
        allowed = torch.isfinite(scores).cpu()
        for i, row in enumerate(requests):  # advance each matcher by a random allowed token
            ids = allowed[i].nonzero().flatten().tolist()
            token = rng.choice(ids)
            row.matcher.accept_token(token)
            assert unfolded_matchers[i].accept_token(token)
    fill, apply = statistics.median(fill_ms), statistics.median(apply_ms)
    # Exposed: what the mask adds to a step whose forward is already queued (on a CPU nothing is hidden).
    exposed = statistics.median(step_ms) - statistics.median(forward_only_ms) if on_gpu else fill + apply
    result = dict(
        stage="mask",
        device=device,
        rows=rows,
        vocab=vocab,
        compile_ms=1e3 * compile_s,
        fill_threads=FILL_THREADS,
        fill_ms_per_step=fill,
        fill_ms_mean=statistics.mean(fill_ms),  # the cost is bimodal: a few grammar states are expensive
        fill_ms_p90=statistics.quantiles(fill_ms, n=10)[-1],
        apply_ms_per_step=apply,
        mask_ms_per_step=fill + apply,
        us_per_token=1e3 * (fill + apply) / rows,
        stand_in_forward_ms=statistics.median(forward_only_ms),
        exposed_mask_ms_per_step=exposed,
        exposed_mask_ms_mean=(
            statistics.mean(step_ms) - statistics.mean(forward_only_ms)
            if on_gpu
            else statistics.mean(fill_ms) + statistics.mean(apply_ms)
        ),
        fill_ms_by_threads={n: (statistics.median(v[10:]), statistics.mean(v[10:])) for n, v in sweep_ms.items()},
        # mean per step, and per row in us, of the fill on FILL_THREADS: folded (the engine's) vs xgrammar's own
        fill_mean_ms_folded_vs_unfolded=(
            statistics.mean(sweep_ms[FILL_THREADS][10:]),
            statistics.mean(unfolded_ms[10:]),
        ),
        fill_us_per_row_folded_vs_unfolded=(
            1e3 * statistics.mean(sweep_ms[FILL_THREADS][10:]) / rows,
            1e3 * statistics.mean(unfolded_ms[10:]) / rows,
        ),
    )
    print(json.dumps(result), flush=True)
    return result


def _stand_in_forward(device: str, target_ms: float):
    """GPU work of about `target_ms` (a chain of matmuls), queued asynchronously like a model forward."""
    import torch

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
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


async def throughput(model_dir: str, rows: int, new_tokens: int) -> list[dict]:
    from router.client import ZmqEngineClient
    from router.config import EngineConfig

    client = await ZmqEngineClient.start(EngineConfig(model_id=model_dir))
    rng, ids, results = random.Random(0), iter(range(10**9)), []

    async def one(prompt: list[int], grammar: GrammarSpec | None, max_new: int) -> int:
        request = GenerateRequest(f"g{next(ids)}", prompt, max_new_tokens=max_new, ignore_eos=True, grammar=grammar)
        tokens = 0
        async for batch in client.generate_batches(request):
            tokens += sum(len(e.token_ids) for e in batch)
            if batch[-1].error:
                raise RuntimeError(batch[-1].error)
        return tokens

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)] for _ in range(n)]

    try:
        await asyncio.gather(*(one(p, SPEC, 16) for p in prompts(8)))  # warm-up, grammar compiled and cached
        for rep in range(2):
            for constrained in (False, True):
                batch = prompts(rows)
                start = time.perf_counter()
                counts = await asyncio.gather(*(one(p, SPEC if constrained else None, new_tokens) for p in batch))
                seconds = time.perf_counter() - start
                result = dict(
                    stage="throughput",
                    constrained=constrained,
                    rep=rep,
                    rows=rows,
                    tokens=sum(counts),
                    seconds=seconds,
                    tok_s=sum(counts) / seconds,
                )
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        await client.shutdown()
    plain = statistics.mean(r["tok_s"] for r in results if not r["constrained"])
    constrained = statistics.mean(r["tok_s"] for r in results if r["constrained"])
    # What the grammar adds to a step end to end (fill not hidden behind the forward, apply, the deferred
    # sampling's launch gap): the step time of the constrained load minus the plain one's.
    exposed = 1e3 * rows * (1 / constrained - 1 / plain)
    summary = dict(
        stage="summary",
        plain_tok_s=plain,
        constrained_tok_s=constrained,
        ratio=constrained / plain,
        exposed_grammar_ms_per_step=exposed,
    )
    print(json.dumps(summary), flush=True)
    return [*results, summary]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?", default="/tmp/llama3-8b-random")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mask-only", action="store_true")
    parser.add_argument("--mask-steps", type=int, default=200)
    args = parser.parse_args()
    results = [mask_cost(args.model_dir, args.rows, args.device, args.mask_steps)]
    if not args.mask_only:
        results += asyncio.run(throughput(args.model_dir, args.rows, args.new_tokens))
    with open(os.path.join(os.environ.get("OUT", "."), "grammar_bench.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
