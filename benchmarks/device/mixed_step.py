"""What a step that mixes a prompt chunk into a running decode batch costs, against the decode step it interrupts
(the 64-stream ITL p99 bar: p99 within 2x of p50; on an H100 p99 was 4.1x, docs/benchmarks/2026-12-05-session-23.md).

    python3 -m benchmarks.device.mixed_step [--rows 64] [--chunks 64,256,1024,4096]   # ~2 min on an H100
    python3 -m benchmarks.device.mixed_step --device cpu                              # a smoke run (tests run it)

Random Llama-3-8B (bf16) through ModelRunner, `rows` requests decoding at a CONTEXT-token context, then per chunk
size P: the decode step replayed from its CUDA graph; the same step eager; the mixed step (the rows' decodes plus
one request's first P prompt tokens, eager, as the engine runs it); P prompt tokens alone. Each is timed with CUDA
events (wall: the device's timeline, idle gaps included) and once under the profiler (the kernels' own time): wall
minus kernel time is what the host's launches cost the device. Whether a mixed step is dear because of its prefill
arithmetic, its eager launches or its attention says which fix pays: a smaller chunk, piecewise CUDA graphs of
mixed steps, or a cheaper mixed attention.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.device.steps import build_runner, capture_graphs, decode_batch, fill_context, random_weights
from benchmarks.device.timing import log, out_path, timer, write_json
from benchmarks.shapes import LLAMA3_8B, LLAMA3_TINY
from tgi_compat.modeling.forward_batch import ForwardBatch, build_forward_batch
from tgi_compat.modeling.runner import ModelRunner

CONTEXT = 256


def mixed_batch(runner: ModelRunner, rows: int, chunk: int, max_len: int, vocab: int) -> ForwardBatch:
    """`rows` decodes at CONTEXT + 1 (row i) beside row `rows`' first `chunk` prompt tokens (0: decodes only)."""
    decoding = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(0))  # the same each call
    ids = decoding.tolist() + torch.randint(0, vocab, (chunk,)).tolist()
    q_lens = [1] * rows + ([chunk] if chunk else [])
    kv_lens = [CONTEXT + 1] * rows + ([chunk] if chunk else [])
    slots = [i * max_len + CONTEXT for i in range(rows)] + [rows * max_len + p for p in range(chunk)]
    logits = list(range(rows)) + ([rows + chunk - 1] if chunk else [])
    req_rows = list(range(rows)) + ([rows] if chunk else [])
    return build_forward_batch(ids, req_rows, q_lens, kv_lens, slots, logits, device=runner.device)


def prompt_batch(runner: ModelRunner, rows: int, chunk: int, max_len: int, vocab: int) -> ForwardBatch:
    """Row `rows`' first `chunk` prompt tokens alone."""
    ids = torch.randint(0, vocab, (chunk,)).tolist()
    slots = [rows * max_len + p for p in range(chunk)]
    return build_forward_batch(ids, [rows], [chunk], [chunk], slots, [chunk - 1], device=runner.device)


def kernel_ms(device: torch.device, run: Callable[[], object], reps: int) -> float | None:
    """Mean ms of the kernels' own device time per call (the profiler's sum); None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    total_us = sum(evt.self_device_time_total for evt in prof.key_averages())
    return total_us / 1e3 / reps


def measure(model: dict, dtype: str, device: str, rows: int, chunks: list[int], reps: int) -> dict:
    max_len = max(CONTEXT + 8, max(chunks) + 8)
    weights = random_weights(model, getattr(torch, dtype), device)
    runner = build_runner(model, weights, dtype, None, rows + 1, max_len, device=device)
    fill_context(runner, rows, max_len, CONTEXT)
    vocab, dev = model["vocab_size"], runner.device
    with torch.inference_mode():
        decode = decode_batch(
            torch.randint(0, vocab, (rows,), device=dev), torch.full((rows,), CONTEXT + 1, device=dev), max_len
        )
        report: dict = dict(rows=rows, context=CONTEXT, dtype=dtype, chunks={})
        wall_ms = timer(dev.type, reps)
        if dev.type == "cuda":
            graphs = capture_graphs(runner, [rows])
            report["decode_graph_ms"] = wall_ms(lambda: graphs.replay(decode))
            del graphs
        eager = mixed_batch(runner, rows, 0, max_len, vocab)
        report["decode_eager_ms"] = wall_ms(lambda: runner.forward(eager))
        report["decode_eager_kernel_ms"] = kernel_ms(dev, lambda: runner.forward(eager), reps)
        first = mixed_batch(runner, rows, chunks[0], max_len, vocab)
        # the decode rows' logits do not depend on the prompt beside them (a check that the batch is what it says)
        expected, got = runner.forward(eager).float(), runner.forward(first)[:rows].float()
        report["decode_rows_rel_diff"] = float((got - expected).norm() / expected.norm())
        for chunk in chunks:
            mixed = mixed_batch(runner, rows, chunk, max_len, vocab)
            alone = prompt_batch(runner, rows, chunk, max_len, vocab)
            run_mixed, run_alone = partial(runner.forward, mixed), partial(runner.forward, alone)
            report["chunks"][chunk] = dict(
                mixed_ms=wall_ms(run_mixed),
                mixed_kernel_ms=kernel_ms(dev, run_mixed, reps),
                prompt_alone_ms=wall_ms(run_alone),
            )
            log(f"P={chunk}: {report['chunks'][chunk]}")
    return report


def table(report: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    graph = report.get("decode_graph_ms")
    head = (
        f"{report['rows']} rows decoding at {report['context']} tokens: decode step {ms(graph)} ms from its graph, "
        f"{ms(report['decode_eager_ms'])} ms eager ({ms(report['decode_eager_kernel_ms'])} ms of it kernels)\n\n"
        "| prompt tokens mixed in | mixed step ms | its kernels ms | host-bound gap ms | the prompt alone ms "
        "| mixed / graph decode |\n|---|---|---|---|---|---|"
    )
    lines = [head]
    for chunk, row in report["chunks"].items():
        kernels = row["mixed_kernel_ms"]
        gap = None if kernels is None else row["mixed_ms"] - kernels
        ratio = "-" if graph is None else f"{row['mixed_ms'] / graph:.2f}x"
        lines.append(
            f"| {chunk} | {ms(row['mixed_ms'])} | {ms(kernels)} | {ms(gap)} | {ms(row['prompt_alone_ms'])} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--chunks", default="64,256,1024,4096")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=out_path("mixed_step.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    on_gpu = args.device == "cuda"
    model, dtype = (LLAMA3_8B, "bfloat16") if on_gpu else (LLAMA3_TINY, "float32")
    rows, chunks = (args.rows, [int(c) for c in args.chunks.split(",")]) if on_gpu else (4, [8, 16])
    report = measure(model, dtype, args.device, rows, chunks, args.reps if on_gpu else 2)
    print(table(report), flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
