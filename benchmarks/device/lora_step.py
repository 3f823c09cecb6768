"""Where the time of a LoRA decode step goes: a step whose rows are spread over 8 adapters against the base step
(64 streams over 8 adapters ran ~3.9 ms per step slower than base-only, of which the LoRA kernels alone,
benchmarks/device/lora_kernels.py, explain ~2.2 ms).

    python3 -m benchmarks.device.lora_step [--rows 1,8,64]   # ~2 min on an H100
    python3 -m benchmarks.device.lora_step --device cpu      # a smoke run (tests run it)

Random Llama-3-8B (bf16) through ModelRunner with --max-loras 8, 8 random PEFT adapters of r = 16 on all seven
projections loaded into the 8 slots, rows decoding at a CONTEXT-token context. Per row count, the step replayed
from the runner's own CUDA graphs (a plain and a LoRA graph per bucket, as serving captures them), timed with CUDA
events: `base` no LoRA row (the plain graph, as the router sends a base-only step); `no_rows` the LoRA graph with
every row on -1 (its fixed cost: launches over empty segments); `one` every row on slot 0; `spread` rows
round-robin over the 8 slots. Then the largest row count's base and spread steps once each under the profiler:
the top kernels of each, their kernel time against the timed (wall) step, and the kernels whose time differs most
between the two, which says what spread - base is made of (shrink/expand, the segments' counting sort in
tgi_compat/modeling/lora/step.py, others). Last, the shrink and expand alone (benchmarks/device/lora_kernels.py)
at each tiling of its SWEEP. The CPU run: a tiny Llama, eager steps, no profile, the sweep checked against the
reference. A plain base's decode steps run the folded projections (tgi_compat/modeling/lora/folding.py: the shrink in
the base GEMM, then the folded expand); --segmented times the segmented shrink and expand instead, the path of int8 /
int4 bases and of prefills where the slots' A rows are a large share. --quantize fp8: the same on an FP8 base
(quantized while loading), whose decode steps fold A into the FP8 GEMM. --prefill TOKENS: one eager prefill step of
TOKENS prompt tokens (requests of CONTEXT tokens spread over the 8 adapters) base, through the segmented kernels and
through the folded projections, with the two LoRA outputs' difference.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.device.lora_kernels import ADAPTERS, RANK, SWEEP, folded_expand_times, kernel_times, row_slots
from benchmarks.device.peft_adapters import write_peft_adapter
from benchmarks.device.steps import (
    build_runner,
    decode_batch,
    fill_context,
    prefill_batch,
    profile_step,
    random_weights,
)
from benchmarks.device.timing import log, out_path, timer, write_json
from benchmarks.shapes import LLAMA3_8B, LLAMA3_TINY
from tgi_compat.modeling.forward_batch import ForwardBatch, LoraBatch
from tgi_compat.modeling.lora.adapter import load_peft_adapter
from tgi_compat.modeling.lora.weights import ALWAYS_FOLD, DEFAULT_FOLDING, NEVER_FOLD, folding_policy
from tgi_compat.modeling.runner import ModelRunner

CONTEXT = 256
CASES = ("base", "no_rows", "one", "spread")
TOP = 15


def case_slots(case: str, rows: int, device: torch.device) -> torch.Tensor | None:
    """Each row's adapter slot in a case (None: no LoRA row, the plain step)."""
    if case == "base":
        return None
    if case == "spread":
        return row_slots(rows, ADAPTERS).to(device)
    return torch.full((rows,), -1 if case == "no_rows" else 0, dtype=torch.int64, device=device)


def step_on(runner: ModelRunner, slots: torch.Tensor | None) -> Callable[[ForwardBatch], torch.Tensor]:
    """runner.forward of a decode batch with its rows on `slots` (the runner replays the graph that fits)."""

    def step(batch: ForwardBatch) -> torch.Tensor:
        batch.lora = None if slots is None else LoraBatch(slots)
        logits = runner.forward(batch)
        assert isinstance(logits, torch.Tensor)  # (an unsharded model's: its logits)
        return logits

    return step


def load_adapters(runner: ModelRunner, model: dict, max_len: int) -> None:
    """ADAPTERS random PEFT adapters written to disk, read back, and copied into slots 0..ADAPTERS-1."""
    lora = runner.lora
    assert lora is not None
    with tempfile.TemporaryDirectory() as work:
        for slot in range(ADAPTERS):
            folder = write_peft_adapter(Path(work) / f"a{slot}", model, RANK, seed=slot)
            lora.add(slot + 1, load_peft_adapter(f"a{slot}", str(folder)))
    one = torch.ones(1, dtype=torch.int64, device=runner.device)
    batch = decode_batch(one, one, max_len)
    batch.lora = LoraBatch(one, [(slot, slot + 1) for slot in range(ADAPTERS)])
    lora.begin_step(batch, replayed=True)  # the slot copies only (a replayed step builds no segments here)


def rel_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def checks(runner: ModelRunner, batch: ForwardBatch) -> dict:
    """The spread step's logits differ from the base step's (the adapters apply); on CUDA its graph replay gives
    the eager LoRA step's logits (the LoRA graph is what ran)."""
    spread = case_slots("spread", batch.batch_size, runner.device)
    base = step_on(runner, None)(batch).float().clone()
    replayed = step_on(runner, spread)(batch).float().clone()
    result: dict = dict(spread_vs_base_rel_diff=rel_diff(replayed, base), graph_vs_eager_rel_diff=None)
    if runner.cuda_graphs is not None and runner.lora is not None:
        runner.lora.begin_step(batch)  # batch.lora: the spread slots (step_on set them)
        try:
            result["graph_vs_eager_rel_diff"] = rel_diff(replayed, runner._forward_eager(batch))
        finally:
            runner.lora.set_decode_slots(None)
    log(f"checks: {result}")
    return result


def kernel_diff(base: list[dict], spread: list[dict]) -> list[dict]:
    """us per step of each kernel name in the spread step minus the base step's, largest difference first."""
    per_kernel: dict[str, dict] = {}
    for name, rows in (("base", base), ("spread", spread)):
        for row in rows:
            entry = per_kernel.setdefault(row["kernel"], dict(kernel=row["kernel"], base_us=0.0, spread_us=0.0))
            entry[f"{name}_us"] += row["us_per_step"]
    diff = [entry | dict(diff_us=entry["spread_us"] - entry["base_us"]) for entry in per_kernel.values()]
    return sorted(diff, key=lambda entry: -abs(entry["diff_us"]))


def profile(runner: ModelRunner, rows: int, max_len: int, vocab: int, steps: dict[str, float]) -> dict:
    """The base and spread steps of `rows` rows under the profiler: kernels, kernel vs wall time, their difference."""
    report: dict = {}
    for case in ("base", "spread"):
        log(f"profile: {case}, {rows} rows")
        step = step_on(runner, case_slots(case, rows, runner.device))
        kernels = profile_step(step, rows, max_len, vocab, CONTEXT, top=TOP, keep=None)
        kernel_ms = sum(row["us_per_step"] for row in kernels) / 1e3
        gaps = steps[case] - kernel_ms
        log(f"  {case}: {kernel_ms:.3f} ms of kernels in a {steps[case]:.3f} ms step (gaps {gaps:.3f})")
        report[case] = dict(kernel_ms=kernel_ms, wall_ms=steps[case], kernels=kernels)
    diff = kernel_diff(report["base"]["kernels"], report["spread"]["kernels"])
    kernel_gain = report["spread"]["kernel_ms"] - report["base"]["kernel_ms"]
    log(f"spread - base: {steps['spread'] - steps['base']:.3f} ms of wall, {kernel_gain:.3f} ms of kernels; by kernel:")
    for entry in diff[:TOP]:
        log(f"  {entry['diff_us']:+9.1f} us  ({entry['base_us']:8.1f} -> {entry['spread_us']:8.1f})  {entry['kernel']}")
    report["diff"] = diff
    return report


def measure(model: dict, dtype: str, device: str, row_counts: list[int], reps: int, quantize: str | None) -> dict:
    max_len, top_rows, vocab = CONTEXT + 8, max(row_counts), model["vocab_size"]
    weights = random_weights(model, getattr(torch, dtype), device)
    graph_sizes = row_counts if device == "cuda" else None
    runner = build_runner(
        model, weights, dtype, None, top_rows, max_len, device, graph_sizes,
        max_loras=ADAPTERS, max_lora_rank=RANK, quantize=quantize,
    )  # fmt: skip
    fill_context(runner, top_rows, max_len, CONTEXT)
    load_adapters(runner, model, max_len)
    dev = runner.device
    wall_ms = timer(dev.type, reps)
    report: dict = dict(
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        dtype=dtype,
        quantize=quantize,
        context=CONTEXT,
        adapters=ADAPTERS,
        rank=RANK,
        graphs=graph_sizes is not None,
        steps={},
    )
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (top_rows,), device=dev)
        kv_lens = torch.full((top_rows,), CONTEXT + 1, device=dev)
        for rows in row_counts:
            batch = decode_batch(ids[:rows], kv_lens[:rows], max_len)
            steps = {}
            for case in CASES:
                steps[case] = wall_ms(partial(step_on(runner, case_slots(case, rows, dev)), batch))
            report["steps"][rows] = steps
            log(f"{rows} rows: " + ", ".join(f"{case} {ms:.3f} ms" for case, ms in steps.items()))
        report["checks"] = checks(runner, decode_batch(ids, kv_lens, max_len))
        if dev.type == "cuda":
            report["profile"] = profile(runner, top_rows, max_len, vocab, report["steps"][top_rows])
    return report


def prefill_times(model: dict, dtype: str, device: str, tokens: int, reps: int, quantize: str | None) -> dict:
    """One prefill step of `tokens` tokens (requests of CONTEXT tokens, request i on slot i % 8): base, segmented
    and folded LoRA (ms), and the folded logits' difference from the segmented ones."""
    requests, max_len = tokens // CONTEXT, CONTEXT + 8
    weights = random_weights(model, getattr(torch, dtype), device)
    runner = build_runner(
        model, weights, dtype, None, requests, max_len, device, None,
        max_loras=ADAPTERS, max_lora_rank=RANK, quantize=quantize, max_prefill_tokens=tokens,
    )  # fmt: skip
    load_adapters(runner, model, max_len)
    dev = runner.device
    wall_ms = timer(dev.type, reps)
    prompts = torch.randint(0, model["vocab_size"], (requests, CONTEXT)).tolist()
    batch = prefill_batch(runner, prompts, max_len)
    spread = row_slots(requests, ADAPTERS).to(dev)
    report: dict = dict(tokens=requests * CONTEXT, requests=requests, quantize=quantize)
    logits = {}
    cases = (
        ("base", None, DEFAULT_FOLDING), ("segmented", spread, NEVER_FOLD), ("folded", spread, ALWAYS_FOLD)
    )  # fmt: skip
    with torch.inference_mode():
        for case, slots, policy in cases:
            with folding_policy(policy):
                step = partial(step_on(runner, slots), batch)
                report[case] = wall_ms(step)
                logits[case] = step().float().clone()
    report["folded_vs_segmented_rel_diff"] = rel_diff(logits["folded"], logits["segmented"])
    report["lora_vs_base_rel_diff"] = rel_diff(logits["segmented"], logits["base"])
    log(f"prefill: {report}")
    return report


def table(report: dict) -> str:
    lines = [
        f"ms per decode step{' (FP8 base)' if report['quantize'] else ''} at {report['context']} tokens of context, "
        f"{report['adapters']} adapters of r = "
        f"{report['rank']} ({'CUDA graphs' if report['graphs'] else 'eager'}, {report['device']}); x: / base\n",
        "| rows | (a) base | LoRA step, every row -1 | (b) all on slot 0 | (c) spread over 8 | (c) - (a) |",
        "|---|---|---|---|---|---|",
    ]
    for rows, steps in report["steps"].items():
        base = steps["base"]
        cells = [f"{steps[case]:.3f} ({steps[case] / base:.2f}x)" for case in CASES[1:]]
        lines.append(f"| {rows} | {base:.3f} | {' | '.join(cells)} | {steps['spread'] - base:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=out_path("lora_step.json"))
    parser.add_argument(
        "--segmented",
        action="store_true",
        help="decode steps through the segmented shrink and expand (int8 / int4 bases' path), not the folded projections",
    )
    parser.add_argument("--quantize", choices=("fp8",), default=None, help="an FP8 base, quantized while loading")
    parser.add_argument("--skip-sweep", action="store_true", help="skip the kernels' tiling sweep")
    parser.add_argument(
        "--prefill", type=int, default=0, metavar="TOKENS", help="only a prefill step: base, segmented and folded"
    )
    parser.add_argument(
        "--folded-sweep", action="store_true", help="only the folded expand at each tiling (no model, no steps)"
    )
    args = parser.parse_args()
    with folding_policy(NEVER_FOLD if args.segmented else DEFAULT_FOLDING):
        run(args)


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    on_gpu = args.device == "cuda"
    model, dtype = (LLAMA3_8B, "bfloat16") if on_gpu else (LLAMA3_TINY, "float32")
    row_counts = [int(r) for r in args.rows.split(",")] if on_gpu else [1, ADAPTERS]
    if args.prefill:
        tokens = args.prefill if on_gpu else 2 * CONTEXT
        result = prefill_times(model, dtype, args.device, tokens, args.reps if on_gpu else 1, args.quantize)
        base = result["base"]
        print(
            f"prefill step of {result['tokens']} tokens{' (FP8 base)' if args.quantize else ''}: base {base:.2f} ms, "
            f"segmented {result['segmented']:.2f} ({result['segmented'] / base:.3f}x), folded {result['folded']:.2f} "
            f"({result['folded'] / base:.3f}x)",
            flush=True,
        )
        write_json(args.json, dict(prefill=result))
        return
    if args.folded_sweep:
        sweep = folded_expand_times(model, tuple(row_counts), args.device)
        for result in sweep:
            best = min(result["sweep_us"].items(), key=lambda item: item[1])
            print(
                f"folded expand, {result['rows']} rows: best {best[0]} {best[1]:.0f} us a step; all {result['sweep_us']}"
            )
        write_json(args.json, dict(folded_expand_sweep=sweep))
        return
    report = measure(model, dtype, args.device, row_counts, args.reps if on_gpu else 2, args.quantize)
    print(table(report), flush=True)
    if args.skip_sweep:
        write_json(args.json, report)
        return
    # the kernels alone at each tiling of the sweep; the CPU run checks three of them against the reference, which
    # take each split of K and each block width once (all nine interpreted took 20 s of CI)
    kernel_dtype = torch.bfloat16 if on_gpu else torch.float32
    sweep = SWEEP if on_gpu else SWEEP[::4]
    report["kernel_sweep"] = kernel_times(model, tuple(row_counts), kernel_dtype, args.device, sweep)
    for result in report["kernel_sweep"]:
        for name, us in result.get("sweep_us", {}).items():
            print(f"kernels, {result['rows']} rows, {name}: {us:.0f} us a step", flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
