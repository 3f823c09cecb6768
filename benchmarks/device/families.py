"""GPU benchmark of the newer model families (not CI), one call, random weights, < 8 min on one H100:

0. Tunes the fused-experts kernels for the Mixtral-8x7B expert shapes (benchmarks.device.tune_fused_moe,
   --tune-budget-s; 0 skips it) and runs everything below with that table; the table is printed and
   written to $OUT/fused_moe_tuned.py (copy it over tgi_compat/kernels/moe/tuned.py to keep it).
1. A Mixtral-8x7B-shaped model (all shapes real, `--mixtral-layers` of its 32 layers so that it fits
   one 80 GB GPU): decode steps at 64 streams with the fused-experts Triton kernel vs the eager
   expert-by-expert loop (transformers' MoE algorithm, `fused_moe_ref`), both in this process on the
   same weights and KV; the fused path also with CUDA graphs.
2. The fused-experts block alone at batch 1 (one token, top-2 of 8 Mixtral experts) as a decode step
   runs it (a CUDA graph; eager beside it): time and the bandwidth of its expert-weight reads, beside a
   device copy's bandwidth; then 16 / 64 / 256 tokens against the loop.
3. Gemma-2-9B's down projection at one row: the GeGLU-prologue GEMV against gelu_mul + cuBLAS; then a
   Gemma-2-9B-shaped model: batch-1 decode time per token with CUDA graphs vs its weight-read roofline,
   and a per-kernel profile of one step (eager, and the graph replay) to see where the time above the
   roofline goes. `--unfused-too` also times it with Gemma's sandwich norms unfused (a norm kernel after
   o_proj and after down_proj, as before the norm-add-norm fusion): the fusion's before/after in one call.

    python3 -m benchmarks.device.families [--json FILE]
    python3 -m benchmarks.device.families --family gemma2 [--unfused-too] [--no-profile]   # part 3, ~2-3 min

Decode steps and kernel times as benchmarks.device.steps and benchmarks.device.timing take them.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F

import tgi_compat.modeling.layers.moe as moe_layer
from benchmarks.device.steps import (
    build_runner,
    decode_weight_bytes,
    fill_context,
    profile_step,
    random_weights,
    time_decode,
)
from benchmarks.device.timing import copy_bandwidth, device_info, graph_ms, log, median_ms, out_path, pct_of, write_json
from benchmarks.device.tune_fused_moe import render_table, tune
from benchmarks.shapes import EXPERTS, GEMMA2_9B, MIXTRAL_8X7B
from tgi_compat.kernels.moe.fused_moe import fused_moe, fused_moe_ref, moe_config
from tgi_compat.kernels.moe.routing import fused_route, route_ref
from tgi_compat.kernels.moe.tuned import TUNED
from tgi_compat.modeling.runner import ModelRunner

CONTEXT = 512
STEPS = 32


def build(config: dict, rows: int, max_len: int, graph_sizes: list[int]) -> ModelRunner:
    return build_runner(
        config, random_weights(config, torch.bfloat16), "bfloat16", "triton", rows, max_len, graph_sizes=graph_sizes
    )


def bench_mixtral(layers: int, bandwidth: float) -> dict:
    config = {**MIXTRAL_8X7B, "num_hidden_layers": layers}
    batch, max_len = 64, CONTEXT + STEPS + 8
    t0 = time.perf_counter()
    runner = build(config, batch, max_len, graph_sizes=[1, batch])
    log(f"mixtral ({layers} layers) built with graphs in {time.perf_counter() - t0:.0f} s")
    fill_context(runner, batch, max_len, CONTEXT)
    vocab = config["vocab_size"]
    result = dict(layers=layers)
    result["graphs_b64_ms"] = time_decode(runner.forward, batch, max_len, vocab, STEPS, CONTEXT)
    result["graphs_b1_ms"] = time_decode(runner.forward, 1, max_len, vocab, STEPS, CONTEXT)
    eager = runner._forward_eager
    result["fused_eager_b64_ms"] = time_decode(eager, batch, max_len, vocab, STEPS, CONTEXT)
    # transformers' algorithm: torch routing and the expert loop (the layer looks both up at call time)
    moe_layer.fused_moe, moe_layer.fused_route = fused_moe_ref, route_ref
    try:
        result["loop_eager_b64_ms"] = time_decode(eager, batch, max_len, vocab, 8, CONTEXT)
    finally:
        moe_layer.fused_moe, moe_layer.fused_route = fused_moe, fused_route
    result["speedup_eager"] = result["loop_eager_b64_ms"] / result["fused_eager_b64_ms"]
    result["speedup_graphs"] = result["loop_eager_b64_ms"] / result["graphs_b64_ms"]
    # at 64 rows every expert is chosen: a step reads all weights once, at best at copy bandwidth
    moved = decode_weight_bytes(runner) + batch * (CONTEXT + STEPS // 2) * runner._kv_bytes_per_token()
    result["floor_b64_ms"] = moved / bandwidth * 1e3
    result["pct_roofline_b64"] = 100 * result["floor_b64_ms"] / result["graphs_b64_ms"]
    result["speedup_ceiling"] = result["loop_eager_b64_ms"] / result["floor_b64_ms"]
    for key, value in result.items():
        log(f"mixtral {key}: {value:.3f}" if isinstance(value, float) else f"mixtral {key}: {value}")
    tokens_s = batch * 1e3 / result["graphs_b64_ms"]
    log(f"mixtral 64 streams: {tokens_s:.0f} tok/s with graphs ({layers}/32 layers)")
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


def bench_fused_moe_batch1(bandwidth: float) -> dict:
    experts, inter, hidden, top_k = EXPERTS["mixtral-8x7b"]
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    topk_weights = torch.tensor([[0.6, 0.4]], device="cuda")
    topk_ids = torch.tensor([[1, 5]], device="cuda")
    ms = graph_ms(lambda: fused_moe(x, w13, w2, topk_weights, topk_ids))
    eager_ms = timed(fused_moe, x, w13, w2, topk_weights, topk_ids)
    ref_ms = timed(fused_moe_ref, x, w13, w2, topk_weights, topk_ids)
    moved = top_k * 3 * hidden * inter * 2  # the chosen experts' w1, w3, w2 in bf16
    gbs = moved / (ms * 1e-3) / 1e9
    config = moe_config(1, experts, top_k, inter, hidden)
    result = dict(ms=ms, eager_ms=eager_ms, loop_ms=ref_ms, gb_s=gbs, pct_copy=pct_of(bandwidth, moved, ms))
    result["config"] = repr(config)
    log(
        f"fused_moe batch 1 (graph): {ms * 1e3:.1f} us, {gbs:.0f} GB/s ({result['pct_copy']:.1f}% of copy);"
        f" eager {eager_ms * 1e3:.1f} us; loop {ref_ms * 1e3:.1f} us; {config}"
    )
    for tokens in (16, 64, 256):
        xt = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
        weights = torch.full((tokens, top_k), 1 / top_k, device="cuda")
        fused = graph_ms(lambda xt=xt, ids=ids, weights=weights: fused_moe(xt, w13, w2, weights, ids))
        fused_eager = timed(fused_moe, xt, w13, w2, weights, ids)
        loop = timed(fused_moe_ref, xt, w13, w2, weights, ids)
        result[f"t{tokens}"] = dict(fused_ms=fused, fused_eager_ms=fused_eager, loop_ms=loop)
        log(f"fused_moe {tokens} tokens: {fused:.3f} ms (graph), {fused_eager:.3f} ms (eager) vs loop {loop:.3f} ms")
    return result


def timed(fn, *args) -> float:
    return median_ms(lambda: fn(*args))


def bench_geglu_down(bandwidth: float) -> dict:
    """Gemma-2-9B's down projection at one decode row: the GeGLU-prologue GEMV the model runs against
    the unfused pair (gated kernel + cuBLAS), each a CUDA graph over 8 weight copies (> L2)."""
    from tgi_compat.kernels.elementwise.silu_mul import silu_mul
    from tgi_compat.kernels.gemv.gemv import gemv

    hidden, inter = GEMMA2_9B["hidden_size"], GEMMA2_9B["intermediate_size"]
    weights = [torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
    x = torch.randn(1, 2 * inter, device="cuda", dtype=torch.bfloat16)
    fused = graph_ms(lambda: [gemv(x, w, silu_mul=True, gelu_tanh=True) for w in weights]) / len(weights)
    unfused = graph_ms(lambda: [F.linear(silu_mul(x, gelu_tanh=True), w) for w in weights]) / len(weights)
    gb_s = hidden * inter * 2 / (fused * 1e-3) / 1e9
    log(
        f"gemma2 down (GeGLU) at 1 row: fused GEMV {fused * 1e3:.1f} us ({gb_s:.0f} GB/s) vs gelu_mul + cuBLAS {unfused * 1e3:.1f} us"
    )
    return dict(fused_us=fused * 1e3, unfused_us=unfused * 1e3, fused_gb_s=gb_s)


def unfused_sandwich_ops():
    """The Triton layer ops with Gemma's norm-add-norm unfused the way the model ran before: x's norm as a
    kernel of its own, then the residual add and the next norm in the projection's GEMV prologue."""
    import dataclasses

    from tgi_compat.modeling.layers.triton_ops import TRITON_OPS, triton_rms_norm_linear

    def norm_then_rms_norm_linear(x, x_norm, residual, norm, proj):
        return triton_rms_norm_linear(x_norm(x)[0], residual, norm, proj)

    return dataclasses.replace(TRITON_OPS, norm_add_norm_linear=norm_then_rms_norm_linear)


def bench_gemma2(bandwidth: float, profile: bool, unfused: bool = False) -> dict:
    import tgi_compat.modeling.runner

    max_len = CONTEXT + STEPS + 8
    t0 = time.perf_counter()
    select_ops = tgi_compat.modeling.runner.select_ops
    if unfused:
        tgi_compat.modeling.runner.select_ops = lambda device: unfused_sandwich_ops()
    try:
        runner = build(GEMMA2_9B, 1, max_len, graph_sizes=[1])
    finally:
        tgi_compat.modeling.runner.select_ops = select_ops
    label = "gemma2-9b" + (" (sandwich norms unfused)" if unfused else "")
    log(f"{label} built with graphs in {time.perf_counter() - t0:.0f} s")
    fill_context(runner, 1, max_len, CONTEXT)
    vocab = GEMMA2_9B["vocab_size"]
    ms = time_decode(runner.forward, 1, max_len, vocab, STEPS, CONTEXT)
    eager_ms = time_decode(runner._forward_eager, 1, max_len, vocab, STEPS, CONTEXT)
    moved = decode_weight_bytes(runner) + (CONTEXT + STEPS // 2) * runner._kv_bytes_per_token()
    floor_ms = moved / bandwidth * 1e3
    result = dict(ms=ms, eager_ms=eager_ms, floor_ms=floor_ms, pct_roofline=100 * floor_ms / ms, gb=moved / 1e9)
    log(
        f"{label} batch 1: {ms:.3f} ms/token (eager {eager_ms:.3f}), floor {floor_ms:.3f} ms: {100 * floor_ms / ms:.1f}%"
    )
    if profile:
        log(f"{label} profile, graph replay (kernels inside the graph):")
        result["profile_graph"] = profile_step(runner.forward, 1, max_len, vocab, CONTEXT)
        log(f"{label} profile, eager:")
        result["profile_eager"] = profile_step(runner._forward_eager, 1, max_len, vocab, CONTEXT)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixtral-layers", type=int, default=16, help="of 32; 16 is ~47 GB of bf16 weights")
    parser.add_argument("--json", default=out_path("bench_families.json"))
    parser.add_argument("--tune-budget-s", type=float, default=120.0, help="fused-MoE tuning time; 0: the table as is")
    parser.add_argument("--no-profile", action="store_true", help="skip the Gemma-2 per-kernel profile")
    parser.add_argument(
        "--family",
        choices=["all", "gemma2", "moe"],
        default="all",
        help="gemma2: only part 3 (no fused-MoE tuning); moe: only parts 0-2",
    )
    parser.add_argument(
        "--unfused-too", action="store_true", help="also time Gemma-2 with its sandwich norms unfused (before/after)"
    )
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    results = device_info(bandwidth)
    if args.family in ("all", "gemma2"):
        results["gemma2_down"] = bench_geglu_down(bandwidth)
        results["gemma2_9b"] = bench_gemma2(bandwidth, not args.no_profile)
        if args.unfused_too:
            results["gemma2_9b_unfused"] = bench_gemma2(bandwidth, not args.no_profile, unfused=True)
    if args.family in ("all", "moe"):
        results.update(bench_moe(args, bandwidth))
    write_json(args.json, results)


def bench_moe(args: argparse.Namespace, bandwidth: float) -> dict:
    """Parts 0-2: the fused-MoE tuning, the kernel at batch 1 and by token count, the Mixtral-shaped model."""
    results: dict = {}
    if args.tune_budget_s > 0:
        tuned, results["tune"] = tune("mixtral-8x7b", args.tune_budget_s)
        text = render_table(EXPERTS["mixtral-8x7b"], tuned, torch.cuda.get_device_name())
        log(text)
        with open(out_path("fused_moe_tuned.py"), "w") as f:
            f.write(text)
        experts, inter, hidden, _ = EXPERTS["mixtral-8x7b"]
        TUNED.update({(experts, inter, hidden, tokens): config for tokens, config in tuned.items()})
    results["fused_moe_batch1"] = bench_fused_moe_batch1(bandwidth)
    results["mixtral"] = bench_mixtral(args.mixtral_layers, bandwidth)
    return results


if __name__ == "__main__":
    main()
