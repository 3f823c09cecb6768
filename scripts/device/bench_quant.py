"""GPU benchmark of quantization (not CI), one call (< 8 min on an H100), random Llama-3-8B weights
built on the device:

    PYTHONPATH=$PWD python3 scripts/device/bench_quant.py [--json $OUT/bench_quant.json] [--no-sweep]
        [--int4-budget-s 150] [--time-limit-s 540] [--multi-rows] [--parts kernels,steps,attention,kv]
        [--fp8-tuned $OUT/fp8_gemm_tuned.json]   (bench_fp8_gemm.py's best FP8 GEMM configs for the steps)
        [--profile-b1]   (the decode steps' GPU time per kernel at batch 1)

1. each weight format's few-row GEMV (tgi_compat.kernels.gemv.gemv: bf16, FP8, int8, int4 in groups of 128) at
   Llama-3-8B's four projection shapes, one row, as % of the copy bandwidth, with the prologue the model
   fuses into that projection; FP8's small config sweep;
   with --multi-rows 2-8 rows; the path each replaces (cuBLAS, per-token FP8 + _scaled_mm, dequant_matmul);
   GPU correctness (bf16 activations, 1 and 8 rows, FP8 subnormal weights, int4 split-K over 200 launches);
2. the int4 GEMV's sweep: coordinate descent over block_n, block_k, num_warps, num_stages, prefetch,
   split_k and separate_prologue per shape at 1, 2, 4 and 8 rows (GB/s per config, the default against the
   best, TUNED_INT4's literal); the best FP8 and int4 configs are then installed for the decode steps;
3. decode step time (CUDA graphs, context 512) at batch 1, 8 and 64 for bf16, --quantize fp8, eetq (W8A16)
   and w4a16_int4 (W4A16), the same model and call; ratios to bf16;
4. FP8 KV: decode attention at 32k context, bf16 vs FP8 KV, with the model backend's split count and
   key block, and the best of a small sweep of each;
5. FP8 KV: KV slots from the same free memory vs bf16 KV;
6. (--parts int4_one_row, ~1 min with --int4-budget-s 35) the one-row int4 GEMV (tgi_compat/kernels/gemv/int4_one_row.py)'s
   configs against the default int4 config, per Llama-3-8B projection with its prologue: us, % of copy bandwidth,
   GPU relative error; the steps then run each shape's fastest.
7. (--parts gemlite) GemLite's int4 GEMV (`pip install gemlite`, the Triton library SGLang and TorchAO use for
   4-bit weights; carry its wheel in .whl) against ours at one row on the same weights: us, % of copy bandwidth,
   relative error. Decides whether W4A16's one-row GEMVs (24-38% of copy bandwidth) should come from GemLite.
The JSON is rewritten after each part; parts 4 and 5 are skipped when --time-limit-s would be passed.
"""

# ruff: noqa: B023  (each lambda is timed inside the loop iteration that defines it)

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))

from bench_gpu import copy_bandwidth, fill_context, graph_ms, log, profile_step, time_decode
from common import LLAMA3_8B, capture_graphs, hf_model
from tune_gemv import graph_us

from tgi_compat.kernels.attention.decode import choose_block_n, choose_num_splits, decode_attention
from tgi_compat.kernels.elementwise.rmsnorm import rmsnorm
from tgi_compat.kernels.gemv import tuned as gemv_tuned
from tgi_compat.kernels.gemv.config import int4_config, int4_register_estimate
from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.int4 import int4_launch_tiles
from tgi_compat.kernels.gemv.int4_one_row import one_row_tiles
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_NONE,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    WEIGHT_DENSE,
    WEIGHT_INT4,
    WEIGHT_ROW_SCALED,
    GemvConfig,
    QuantizedWeight,
)
from tgi_compat.kernels.quant.dequant_matmul import dequant_matmul, dequant_matmul_ref
from tgi_compat.kernels.quant.int4_layout import pack_int4
from tgi_compat.kernels.quant.per_token import quant_per_token, rmsnorm_quant_per_token
from tgi_compat.kernels.split_k import split_k_counters
from tgi_compat.modeling.attention.triton_backend import MAX_DECODE_SPLITS
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

DEVICE = "cuda"  # the GEMV cases' tensors (a CPU dry run of the sweep's logic sets "cpu")
CONTEXT, STEPS, BATCHES = 512, 64, [1, 8, 64]
SCHEMES = [None, "fp8", "eetq", "w4a16_int4"]


def decode_steps(hf_config: dict, state_dict: dict, quantize: str | None, profile_b1: bool = False) -> dict:
    max_len = CONTEXT + STEPS + 8
    cfg = RunnerConfig(device="cuda", dtype="bfloat16", attention_backend="triton", num_kv_slots=65 * max_len + 1,
                       max_rows=65, max_seq_len=max_len, show_progress=False, cuda_graph_batch_sizes=[],
                       quantize=quantize)  # fmt: skip
    runner = ModelRunner.from_hf_state_dict(hf_config, state_dict, cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    fill_context(runner, max(BATCHES), max_len)
    graphs = capture_graphs(runner, BATCHES)
    out = {"weight_gb": weight_bytes / 1e9}
    for batch in BATCHES:
        ms = time_decode(graphs.replay, batch, max_len, hf_config["vocab_size"], STEPS)
        out[f"b{batch}_ms"], out[f"b{batch}_tok_s"] = ms, batch * 1e3 / ms
    if profile_b1:  # GPU time per kernel in a batch-1 graph replay (under PDL a kernel's time includes its wait)
        out["profile_b1"] = profile_step(graphs.replay, 1, max_len, hf_config["vocab_size"])
    log(f"{quantize or 'bf16':>10}: weights {out['weight_gb']:.1f} GB, batch 1 {out['b1_ms']:.3f} ms/step, "
        f"batch 8 {out['b8_ms']:.3f} ms/step, batch 64 {out['b64_tok_s']:.0f} tok/s")  # fmt: skip
    del graphs, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def kv_capacity(hf_config: dict, state_dict: dict) -> dict:
    slots = {}
    for kv in (None, "fp8_e4m3fn"):
        cfg = RunnerConfig(device="cuda", dtype="bfloat16", max_rows=64, show_progress=False,
                           cuda_graph_batch_sizes=[], kv_cache_dtype=kv, memory_fraction=0.9)  # fmt: skip
        runner = ModelRunner.from_hf_state_dict(hf_config, state_dict, cfg)
        slots[kv or "bf16"] = runner.num_kv_slots
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    ratio = slots["fp8_e4m3fn"] / slots["bf16"]
    log(f"KV slots in the same memory: bf16 {slots['bf16']}, fp8 {slots['fp8_e4m3fn']} ({ratio:.2f}x)")
    return {"slots": slots, "ratio": ratio}


ATTENTION_SWEEP = [(64, 4, 1), (64, 4, 2), (128, 4, 1), (128, 4, 2), (128, 8, 2), (256, 8, 1)]


def attention_32k(bandwidth: float) -> list[dict]:
    """Decode attention at 32k context, bf16 vs FP8 KV: with the split count and key block the model's
    backend chooses (4 warps, 2 stages), then the best of a sweep over (block_n, num_warps, splits x1/x2)."""
    rows = []
    context, heads, kv_heads, dim = 32768, 32, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in (1, 8):
        times = {}
        base_splits = choose_num_splits(batch, kv_heads, sms, MAX_DECODE_SPLITS)
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            k = torch.randn(batch * context + 1, kv_heads, dim, device="cuda").to(dtype)
            v = torch.randn_like(k, dtype=torch.float32).to(dtype)
            req_to_token = torch.arange(batch * context, device="cuda", dtype=torch.int32).view(batch, context)
            rows_t = torch.arange(batch, device="cuda")
            kv_lens = torch.full((batch,), context, device="cuda")
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            moved = 2 * batch * context * kv_heads * dim * k.element_size()

            def run(block_n: int, warps: int, splits: int) -> float:
                return graph_ms(lambda: decode_attention(q, k, v, req_to_token, rows_t, kv_lens, 0.088, splits,
                                                         block_n=block_n, num_warps=warps))  # fmt: skip

            model_block = choose_block_n(batch, kv_heads, sms)
            ms = run(model_block, 4, base_splits)
            swept = sorted((run(bn, w, min(64, base_splits * x)), (bn, w, min(64, base_splits * x)))
                           for bn, w, x in ATTENTION_SWEEP)  # fmt: skip
            times[name], times[name + " best"] = ms, swept[0][0]
            for kernel, t, config in (
                ("as the model runs", ms, (model_block, 4, base_splits)),
                ("best swept", *swept[0]),
            ):
                pct = 100 * moved / (t * 1e-3) / bandwidth
                rows.append(dict(batch=batch, kv=name, kernel=kernel, config=config, ms=t, pct_bw=pct))
                log(f"  decode attention 32k batch {batch} {name:4s} {kernel:17s} {t:.4f} ms {pct:5.1f}% of copy "
                    f"bandwidth (block_n, warps, splits) = {config}")  # fmt: skip
        log(f"decode attention 32k, batch {batch}: bf16 {times['bf16']:.3f} ms, fp8 {times['fp8']:.3f} ms "
            f"({times['bf16'] / times['fp8']:.2f}x as the model runs; best swept {times['bf16 best']:.3f} vs "
            f"{times['fp8 best']:.3f} ms, {times['bf16 best'] / times['fp8 best']:.2f}x)")  # fmt: skip
    return rows


SHAPES = {  # Llama-3-8B's projections: (N, K, the prologue the model fuses into each at decode)
    "qkv": (6144, 4096, PROLOGUE_RMSNORM),
    "o": (4096, 4096, PROLOGUE_NONE),
    "gate_up": (28672, 4096, PROLOGUE_RMSNORM),
    "down": (4096, 14336, PROLOGUE_SILU_MUL),
}
FORMATS = {"bf16": WEIGHT_DENSE, "fp8": WEIGHT_ROW_SCALED, "int8": WEIGHT_ROW_SCALED, "int4": WEIGHT_INT4}
GROUP = 128
PROLOGUE_NAMES = {PROLOGUE_NONE: "plain", PROLOGUE_RMSNORM: "rmsnorm+residual", PROLOGUE_SILU_MUL: "silu_mul"}
PROLOGUE_CONSTANTS = {PROLOGUE_NONE: "PROLOGUE_NONE", PROLOGUE_RMSNORM: "PROLOGUE_RMSNORM",
                      PROLOGUE_SILU_MUL: "PROLOGUE_SILU_MUL"}  # fmt: skip
# FP8 / int8 GEMV configs swept at one row (GemvConfig's fields in order: block_n, block_k, num_warps, num_stages,
# prefetch, split_k, separate_prologue), with the prologue the model fuses into each projection; bf16 runs its
# tuned configs (scripts/device/tune_gemv.py sweeps those).
SWEEP_ROW_SCALED = [  # at most 64 fp32 accumulators a thread (block_n x block_k / threads), with and without prefetch
    (8, 1024, 4, 1),
    (16, 512, 4, 1),
    (8, 2048, 8, 1),
    (16, 1024, 8, 1),
    (32, 512, 8, 1),
    (4, 2048, 4, 1),
    (4, 4096, 8, 1),
    (8, 1024, 4, 1, True),
    (16, 512, 4, 1, True),
    (8, 2048, 8, 1, True),
    (16, 1024, 8, 1, True),
    (32, 512, 8, 1, True),
    (4, 2048, 4, 1, True),
    (16, 512, 4, 1, False, 1, True),
]  # the last: separate_prologue
# The int4 GEMV is tuned by coordinate descent from its rule-of-thumb config (tgi_compat.kernels.gemv.config.int4_config): one axis
# at a time over these values, keeping the best, two rounds at one row and one at 2-8 rows, skipping configs that
# would spill on sm_90 (tgi_compat.kernels.gemv.config.int4_register_estimate), within a time budget (compiles dominate).
INT4_AXES = {
    "block_k": (256, 512, 1024, 2048, 4096),
    "num_warps": (1, 2, 4, 8),
    "block_n": (2, 4, 8, 16),
    "split_k": (1, 2, 4),
    "num_stages": (1, 3),
    "prefetch": (False, True),
    "separate_prologue": (False, True),
    "one_row": (False, True),  # one row only: tgi_compat/kernels/gemv/int4_one_row.py instead of the tile kernel
}
INT4_ROW_AXES = ("block_k", "num_warps", "block_n", "split_k", "separate_prologue")  # at 2-8 rows
# (block_n, block_k, split_k): the twelfth session's H100 sweep's best (the fp32 kernel's)
INT4_ONE_ROW_SEEDS = [(16, 4096, 1), (16, 2048, 7), (8, 4096, 1)]
# Starting points measured beside the default at one row (block_n, block_k, num_warps, split_k): K tiles of 1,024
# features a warp, where x's layout is the weight tile's (see tgi_compat.kernels.gemv.config.int4_config), which one axis at a time
# cannot reach from another such point; split-K keeps that ratio per split.
INT4_SEEDS = [(4, 4096, 4, 1), (8, 4096, 4, 1), (2, 4096, 4, 1), (8, 2048, 2, 1), (4, 2048, 2, 1), (8, 1024, 1, 1),
              (8, 2048, 2, 2), (4, 1024, 1, 2), (8, 2048, 4, 1)]  # fmt: skip
INT4_ROWS = [1, 2, 4, 8]
MULTI_ROWS = [2, 4, 8]


def make_weight(fmt: str, n: int, k: int) -> torch.Tensor | QuantizedWeight:
    if fmt == "bf16":
        return torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
    if fmt == "int4":
        scale = torch.rand(n, k // GROUP, device=DEVICE, dtype=torch.bfloat16) / 100
        zero = torch.randint(0, 16, scale.shape, device=DEVICE).to(torch.bfloat16)
        return QuantizedWeight(pack_int4(torch.randint(0, 16, (n, k), device=DEVICE), GROUP), scale, zero, GROUP)
    scale = torch.rand(n, device=DEVICE) / 100
    if fmt == "fp8":
        return QuantizedWeight(torch.randn(n, k, device=DEVICE).to(torch.float8_e4m3fn), scale)
    return QuantizedWeight(torch.randint(-128, 128, (n, k), device=DEVICE, dtype=torch.int8), scale)


def weight_bytes(w: torch.Tensor | QuantizedWeight) -> int:
    tensors = [w] if isinstance(w, torch.Tensor) else [t for t in (w.data, w.scale, w.zero) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


class GemvCase:
    """Inputs of one shape for every prologue and row count; calls over enough weight copies (> 4x L2)
    that each is read from HBM, as each layer's weights are in a real step."""

    def __init__(self, k: int):
        self.x = torch.randn(max(MULTI_ROWS), 2 * k, device=DEVICE, dtype=torch.bfloat16)
        self.residual = torch.randn(max(MULTI_ROWS), k, device=DEVICE, dtype=torch.bfloat16)
        self.summed = torch.empty_like(self.residual)
        self.norm_weight = 1 + 0.1 * torch.randn(k, device=DEVICE, dtype=torch.bfloat16)
        self.k = k

    def args(self, prologue: int, rows: int) -> tuple[torch.Tensor, dict]:
        if prologue == PROLOGUE_SILU_MUL:
            return self.x[:rows], {"silu_mul": True}
        x = self.x[:rows, : self.k]
        if prologue == PROLOGUE_RMSNORM:
            residual, summed = self.residual[:rows], self.summed[:rows]
            return x, dict(norm_weight=self.norm_weight, eps=1e-5, residual=residual, residual_out=summed)
        return x, {}

    def run(self, w, prologue: int, rows: int = 1, config: GemvConfig | None = None) -> torch.Tensor:
        x, kwargs = self.args(prologue, rows)
        return gemv(x, w, config=config, **kwargs)

    def ref(self, w, prologue: int, rows: int) -> torch.Tensor:
        x, kwargs = self.args(prologue, rows)
        kwargs.pop("residual_out", None)
        return gemv_ref(x, w, **kwargs)[0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def gemv_kernels(bandwidth: float, sweep: bool, multi_rows: bool) -> dict:
    """Per shape and weight format at one row: the GEMV (model's prologue, default config) and the best
    swept config as % of the copy bandwidth, beside the paths they replace; 2-8 rows; GPU correctness."""
    report = {"rows": [], "checks": [], "best_configs": {}, "tuned_row_scaled": {}}
    for shape, (n, k, prologue) in SHAPES.items():
        case = GemvCase(k)
        for fmt in FORMATS:
            bench_format(report, case, shape, n, prologue, fmt, bandwidth, sweep, multi_rows)
            torch.cuda.empty_cache()
    report["checks"].append(fp8_subnormals_check())
    report["checks"] += many_rows_checks()
    report["checks"] += split_k_checks()
    if report["best_configs"]:
        log("best fp8 GEMV configs at one row (block_n, block_k, num_warps, num_stages[, prefetch, ...]):")
        for key, config in report["best_configs"].items():
            log(f"  {key:14s} {config}")
        log("TUNED_ROW_SCALED = {  # tgi_compat/kernels/gemv/tuned.py")
        for (n, k, prologue), config in report["tuned_row_scaled"].items():
            log(f"    ({n}, {k}, {PROLOGUE_CONSTANTS[prologue]}): {config_literal(config)},")
        log("}")
    return report


def config_literal(config: GemvConfig) -> str:
    """`config` as the shortest GemvConfig(...) call (fields at their defaults left out)."""
    default = GemvConfig()
    fields = [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
              if getattr(config, f.name) != getattr(default, f.name)]  # fmt: skip
    return f"GemvConfig({', '.join(fields)})"


def int4_sweep(bandwidth: float, budget_s: float) -> dict:
    """The int4 GEMV by coordinate descent (INT4_AXES) from its rule-of-thumb config, per Llama-3-8B projection
    and row count, within `budget_s` seconds: one round at one row, then at 8, 2 and 4 rows, then a second round
    at one row. Prints GB/s per config, the default against the best, and the TUNED_INT4 literal."""
    report: dict = {"timings": [], "cases": [], "tuned": {}}
    cases = {shape: GemvCase(k) for shape, (_, k, _) in SHAPES.items()}
    weights = {}
    for shape, (n, k, _) in SHAPES.items():
        w0 = make_weight("int4", n, k)
        copies = max(1, -(-200_000_000 // weight_bytes(w0)))
        weights[shape] = [w0] + [make_weight("int4", n, k) for _ in range(copies - 1)]
    timed: dict[tuple[int, str], dict[GemvConfig, float]] = {}  # (rows, shape) -> config -> us
    deadline = time.monotonic() + budget_s

    def measure(rows: int, shape: str, config: GemvConfig) -> None:
        n, k, prologue = SHAPES[shape]
        separate = config.separate_prologue and prologue != PROLOGUE_NONE
        if config.one_row and rows == 1:  # one key per config it runs: its own tile and split rules
            periods, _, split_k = one_row_tiles(k, GROUP, config)
            config = dataclasses.replace(config, block_k=periods * GROUP, split_k=split_k, separate_prologue=separate)
        else:
            block_k, split_k = int4_launch_tiles(k, GROUP, config)
            config = dataclasses.replace(config, block_k=block_k, split_k=split_k, separate_prologue=separate,
                                         one_row=False)  # fmt: skip
        seen = timed.setdefault((rows, shape), {})
        spills = not config.one_row and int4_register_estimate(config, rows) > 200
        if config in seen or spills or time.monotonic() > deadline:
            return
        case, moved = cases[shape], weight_bytes(weights[shape][0])
        try:
            t_us = graph_us([lambda w=w: case.run(w, prologue, rows, config) for w in weights[shape]])
        except Exception as exc:  # a config Triton cannot build (registers, shared memory)
            log(f"    int4 {shape} {rows} row(s) {config_literal(config)} failed: {type(exc).__name__}")
            t_us = float("inf")
        seen[config] = t_us
        gbs = moved / (t_us * 1e-6) / 1e9
        report["timings"].append(dict(shape=shape, rows=rows, config=dataclasses.asdict(config), us=t_us, gb_s=gbs,
                                      pct_bw=100 * gbs * 1e9 / bandwidth))  # fmt: skip
        log(f"    int4 {shape:8s} {rows} row(s) {config_literal(config):72s} {t_us:8.1f} us {gbs:6.0f} GB/s")

    defaults: dict[tuple[int, str], GemvConfig] = {}
    for rows, axes in ((1, INT4_AXES), (8, INT4_ROW_AXES), (2, INT4_ROW_AXES), (4, INT4_ROW_AXES), (1, INT4_AXES)):
        for shape, (n, k, prologue) in SHAPES.items():
            if (rows, shape) not in defaults:
                defaults[(rows, shape)] = int4_config(k, rows, GROUP, n, prologue)
                measure(rows, shape, defaults[(rows, shape)])
                for block_n, block_k, num_warps, split_k in INT4_SEEDS if rows == 1 else []:
                    seed = GemvConfig(block_n, block_k, num_warps, num_stages=1, split_k=split_k)
                    if k % (block_k * split_k) == 0:
                        measure(rows, shape, seed)
                for block_n, block_k, split_k in INT4_ONE_ROW_SEEDS if rows == 1 else []:
                    if k % (block_k * split_k) == 0:
                        measure(rows, shape, GemvConfig(block_n, block_k, block_k // 1024, num_stages=1,
                                                        split_k=split_k, one_row=True))  # fmt: skip
            seen = timed.get((rows, shape))
            if not seen:
                continue  # out of budget
            for axis in axes:
                best = min(seen, key=seen.get)
                for value in INT4_AXES[axis]:
                    measure(rows, shape, dataclasses.replace(best, **{axis: value}))
    for (rows, shape), seen in sorted(timed.items()):
        if not seen:
            continue
        n, k, prologue = SHAPES[shape]
        moved = weight_bytes(weights[shape][0])
        default, best = min(seen, key=lambda c: c != defaults[(rows, shape)]), min(seen, key=seen.get)
        pct = {c: 100 * moved / (seen[c] * 1e-6) / bandwidth for c in (default, best)}
        report["cases"].append(dict(shape=shape, n=n, k=k, rows=rows, configs_timed=len(seen),
                                    default=dataclasses.asdict(default), default_us=seen[default],
                                    default_pct_bw=pct[default], best=dataclasses.asdict(best), best_us=seen[best],
                                    best_pct_bw=pct[best]))  # fmt: skip
        report["tuned"][(n, k, prologue, triton.next_power_of_2(rows))] = best
        log(f"int4 {shape:8s} {rows} row(s): default {seen[default]:7.1f} us ({pct[default]:3.0f}% of copy BW), "
            f"best of {len(seen):2d} {seen[best]:7.1f} us ({pct[best]:3.0f}%) {config_literal(best)}")  # fmt: skip
    log(f"int4 sweep: {len(report['timings'])} configs in {budget_s - max(0.0, deadline - time.monotonic()):.0f} s")
    log("TUNED_INT4 = {  # tgi_compat/kernels/gemv/tuned.py")
    for (n, k, prologue, block_m), config in report["tuned"].items():
        log(f"    ({n}, {k}, {PROLOGUE_CONSTANTS[prologue]}, {block_m}): {config_literal(config)},")
    log("}")
    return report


def one_row_candidates(n: int, k: int) -> list[GemvConfig]:
    """tgi_compat/kernels/gemv/int4_one_row.py's configs to time on one shape: K tiles of 1,024 features a warp (x's layout is
    then the words'), 8, 16 or 32 rows a program, splits that give the SMs enough programs; each with its
    prologue fused and as its own kernel."""
    configs = []
    for block_k, block_n, split in ((4096, 16, 1), (4096, 8, 1), (4096, 32, 1), (2048, 16, 2), (2048, 32, 2),
                                    (2048, 16, 7), (2048, 32, 7), (1024, 16, 14), (1024, 32, 14)):  # fmt: skip
        if split == 1 or k % split == 0 and k // split >= block_k:
            for separate in (False, True):
                configs.append(GemvConfig(block_n=block_n, block_k=block_k, num_warps=block_k // 1024, num_stages=1,
                                          split_k=split, one_row=True, separate_prologue=separate))  # fmt: skip
    return configs


def int4_one_row(bandwidth: float, budget_s: float) -> dict:
    """tgi_compat/kernels/gemv/int4_one_row.py's configs against the default int4 config (TUNED_INT4's) at one row, per
    Llama-3-8B projection, `budget_s` seconds a shape; the fastest config of each shape goes into `tuned`."""
    report: dict = {"rows": []}
    for shape, (n, k, prologue) in SHAPES.items():
        configs = [c for c in one_row_candidates(n, k) if not c.separate_prologue or prologue != PROLOGUE_NONE]
        report["rows"] += time_int4_configs(bandwidth, "int4 one-row", shape, configs, budget_s)
    report["tuned"] = fastest_int4_configs(report["rows"])
    log("TUNED_INT4 one-row entries = {  # tgi_compat/kernels/gemv/tuned.py")
    for (n, k, prologue, rows), config in report["tuned"].items():
        log(f"    ({n}, {k}, {PROLOGUE_CONSTANTS[prologue]}, {rows}): {config_literal(config)},")
    log("}")
    return report


def fastest_int4_configs(rows: list[dict]) -> dict:
    """TUNED_INT4's one-row entries from timed configs (int4_one_row's rows): the fastest correct one a shape
    (the relative error to the dequantized reference within 1e-2)."""
    best: dict = {}
    for row in rows:
        n, k, prologue = SHAPES[row["shape"]]
        if row["rel_err"] <= 1e-2 and ((n, k, prologue, 1) not in best or row["us"] < best[(n, k, prologue, 1)][0]):
            best[(n, k, prologue, 1)] = (row["us"], GemvConfig(**row["config"]))
    for key, (t_us, config) in best.items():
        log(f"int4 one-row fastest {key}: {config_literal(config)} ({t_us:.1f} us)")
    return {key: config for key, (_, config) in best.items()}


def time_int4_configs(
    bandwidth: float, label: str, shape: str, configs: list[GemvConfig], budget_s: float = float("inf")
) -> list[dict]:
    """The default int4 config at one row, then `configs` (until `budget_s` has passed), on one projection with
    the prologue the model fuses: us, % of copy bandwidth, relative error to the dequantized reference."""
    n, k, prologue = SHAPES[shape]
    started = time.monotonic()
    case = GemvCase(k)
    w0 = make_weight("int4", n, k)
    weights = [w0] + [make_weight("int4", n, k) for _ in range(max(1, -(-200_000_000 // weight_bytes(w0))) - 1)]
    ref = case.ref(w0, prologue, 1)
    default = int4_config(k, 1, GROUP, n, prologue)
    out, base_us = [], None
    for config in [default] + configs:
        if time.monotonic() - started > budget_s:
            log(f"{label} {shape:8s}: budget of {budget_s:.0f} s spent, {len(configs) + 1 - len(out)} configs left")
            break
        try:
            err = rel_err(case.run(w0, prologue, 1, config), ref)
            t_us = graph_us([lambda w=w: case.run(w, prologue, 1, config) for w in weights])
        except Exception as exc:  # a config Triton cannot build (registers, shared memory)
            log(f"{label} {shape:8s} {config_literal(config)} failed: {type(exc).__name__}: {exc}")
            continue
        base_us = base_us or t_us
        pct = 100 * weight_bytes(w0) / (t_us * 1e-6) / bandwidth
        out.append(dict(shape=shape, config=dataclasses.asdict(config), us=t_us, pct_bw=pct, rel_err=err,
                        default=config == default))  # fmt: skip
        log(f"{label} {shape:8s} {'default ' if config == default else ''}{config_literal(config):90s} "
            f"{t_us:7.1f} us {pct:3.0f}% of copy BW {base_us / t_us:5.2f}x default, rel err {err:.1e}"
            f"{'' if err <= 1e-2 else ' FAIL'}")  # fmt: skip
    del weights
    torch.cuda.empty_cache()
    return out


def gemlite_rows(bandwidth: float) -> list[dict]:
    """Per Llama-3-8B projection, one row: our int4 GEMV (bare, as GemLite has no fused prologue, and with the model's
    prologue) and GemLite's (its own choice of kernel at one row, autotuned on first call) on the same int4 weights,
    group 128, (q - z) s. Each timed over enough weight copies (> 4x L2) that every call reads HBM."""
    import gemlite
    from gemlite import DType, GemLiteLinear

    log(f"gemlite {getattr(gemlite, '__version__', '?')}")
    out = []
    for shape, (n, k, prologue) in SHAPES.items():
        case = GemvCase(k)
        copies = max(1, -(-200_000_000 // (n * k // 2)))
        ours, theirs = [], []
        for _ in range(copies):
            q = torch.randint(0, 16, (n, k), device=DEVICE)
            scale = torch.rand(n, k // GROUP, device=DEVICE, dtype=torch.bfloat16) / 100
            zero = torch.randint(0, 16, scale.shape, device=DEVICE).to(torch.bfloat16)
            ours.append(QuantizedWeight(pack_int4(q, GROUP), scale, zero, GROUP))
            layer = GemLiteLinear(4, group_size=GROUP, in_features=k, out_features=n, input_dtype=DType.BF16,
                                  output_dtype=DType.BF16)  # fmt: skip
            layer.pack(q.to(torch.uint8), scale, zero, None)
            theirs.append(layer)
        x = case.x[:1, :k]
        ref = case.ref(ours[0], PROLOGUE_NONE, 1)
        theirs[0](x)  # autotunes this shape once, outside the graph
        torch.cuda.synchronize()
        runs = {
            "ours bare": (case.run(ours[0], PROLOGUE_NONE, 1), [lambda w=w: case.run(w, PROLOGUE_NONE, 1) for w in ours]),
            "ours, model's prologue": (None, [lambda w=w: case.run(w, prologue, 1) for w in ours]),
            "gemlite": (theirs[0](x), [lambda layer=layer: layer(x) for layer in theirs]),
        }  # fmt: skip
        row: dict = {"shape": shape, "bytes": weight_bytes(ours[0])}
        for name, (result, calls) in runs.items():
            t_us = graph_us(calls)
            row[name] = dict(us=t_us, pct_bw=100 * row["bytes"] / (t_us * 1e-6) / bandwidth,
                             rel_err=None if result is None else rel_err(result, ref))  # fmt: skip
        out.append(row)
        log(f"gemlite {shape:8s} " + ", ".join(
            f"{name} {r['us']:.1f} us ({r['pct_bw']:.0f}%" + ("" if r["rel_err"] is None else f", err {r['rel_err']:.1e}")
            + ")" for name, r in row.items() if isinstance(r, dict)))  # fmt: skip
        del ours, theirs
        torch.cuda.empty_cache()
    return out


def bench_format(
    report: dict,
    case: GemvCase,
    shape: str,
    n: int,
    prologue: int,
    fmt: str,
    bandwidth: float,
    sweep: bool,
    multi_rows: bool,
) -> None:
    k = case.k
    w0 = make_weight(fmt, n, k)
    moved = weight_bytes(w0)
    weights = [w0] + [make_weight(fmt, n, k) for _ in range(max(1, -(-200_000_000 // moved)) - 1)]

    def us(fn) -> float:
        return graph_us([lambda w=w: fn(w) for w in weights])

    def record(kernel: str, t_us: float) -> None:
        pct = 100 * moved / (t_us * 1e-6) / bandwidth
        report["rows"].append(dict(shape=shape, n=n, k=k, fmt=fmt, kernel=kernel, us=t_us, pct_bw=pct))
        log(f"  {shape:8s} {fmt:5s} {kernel:40s} {t_us:8.1f} us  {pct:5.1f}% of copy bandwidth")

    for num_rows in (1,) if fmt == "bf16" else (1, max(MULTI_ROWS)):  # plain weights: one row only
        err = rel_err(case.run(w0, prologue, num_rows), case.ref(w0, prologue, num_rows))
        report["checks"].append(dict(shape=shape, fmt=fmt, rows=num_rows, rel_err=err, ok=err <= 1e-2))
        log(f"{'PASS' if err <= 1e-2 else 'FAIL'} gemv {shape} {fmt} {num_rows} row(s): rel err {err:.2e}")
    record(f"gemv + {PROLOGUE_NAMES[prologue]} (as the model runs)", us(lambda w: case.run(w, prologue)))
    if sweep and fmt == "fp8":  # int8 runs the fp8 kernels with int8 bytes; int4 has its own sweep (int4_sweep)
        timed = {c: us(lambda w, c=c: case.run(w, prologue, 1, GemvConfig(*c))) for c in SWEEP_ROW_SCALED}
        ranked = sorted(timed, key=timed.get)
        for c in ranked[:3]:
            record(f"gemv sweep {c}", timed[c])
        report["best_configs"][f"{shape} {fmt}"] = ranked[0]
        report["tuned_row_scaled"][(n, k, prologue)] = GemvConfig(*ranked[0])
    if fmt != "bf16" and multi_rows:  # (int4 at 2-8 rows: int4_sweep)
        for num_rows in MULTI_ROWS:
            record(f"gemv {num_rows} rows", us(lambda w, r=num_rows: case.run(w, PROLOGUE_NONE, r)))
    for num_rows in (1, max(MULTI_ROWS)):  # the path the GEMV replaces, at one row and at the row limit
        x = case.x[:num_rows, :k].contiguous()
        if fmt == "bf16":
            record(f"cuBLAS F.linear {num_rows} rows", us(lambda w, x=x: torch.nn.functional.linear(x, w)))
        elif fmt == "fp8":
            record(f"quant_per_token + _scaled_mm {num_rows} rows", us(lambda w, x=x: scaled_mm(x, w)))
        else:
            bits = 4 if fmt == "int4" else 8
            record(f"dequant_matmul {num_rows} rows", us(lambda w, x=x: dequantizing_matmul(x, w, bits)))


def dequantizing_matmul(x: torch.Tensor, w: QuantizedWeight, bits: int) -> torch.Tensor:
    return dequant_matmul(x, w.data, w.scale, w.zero, bits=bits, group_size=w.group_size)


def scaled_mm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    xq, xs = quant_per_token(x, torch.float8_e4m3fn)
    return torch._scaled_mm(xq, w.data.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16)


def fp8_subnormals_check() -> dict:
    """e4m3 subnormal weights (exponent 0) must not be flushed to zero by the kernel's conversion."""
    codes = torch.randint(1, 8, (64, 4096), device="cuda", dtype=torch.uint8)  # mantissa only
    codes[1::2] |= 0x80  # odd rows negative: each row keeps one sign, so its sum is well conditioned
    w = QuantizedWeight(codes.view(torch.float8_e4m3fn), torch.ones(64, device="cuda"))
    x = torch.ones(1, 4096, device="cuda", dtype=torch.bfloat16)
    err = rel_err(gemv(x, w), gemv_ref(x, w)[0])
    log(f"{'PASS' if err <= 1e-2 else 'FAIL'} gemv fp8 subnormal weights: rel err {err:.2e}")
    return dict(shape="64x4096 subnormal", fmt="fp8", rows=1, rel_err=err, ok=err <= 1e-2)


def many_rows_checks() -> list[dict]:
    """The paths above the GEMV's rows, on the GPU (the CPU interpreter cannot run their bf16 dots): the int4
    GEMM at 64 rows against its dequantized reference; the FP8 GEMM fed by the fused RMSNorm + per-token
    quantization (the same bits as the unfused pair) against the fp32 product of the same FP8 operands."""
    out = []
    n, k, rows = 4096, 4096, 64
    w4 = make_weight("int4", n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    err = rel_err(dequantizing_matmul(x, w4, 4), dequant_matmul_ref(x, w4.data, w4.scale, w4.zero, bits=4,
                                                                  group_size=GROUP))  # fmt: skip
    out.append(dict(shape=f"{n}x{k}", fmt="int4 gemm", rows=rows, rel_err=err, ok=err <= 1e-2))
    w8 = make_weight("fp8", n, k)
    norm_weight, residual = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16), torch.randn_like(x)
    summed = torch.empty_like(x)
    q, scale = rmsnorm_quant_per_token(x, norm_weight, 1e-5, torch.float8_e4m3fn, residual, summed)
    q_ref, scale_ref = quant_per_token(rmsnorm(x, norm_weight, 1e-5, residual=residual.clone()), torch.float8_e4m3fn)
    same = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref))
    out.append(dict(shape=f"{rows}x{k}", fmt="rmsnorm+fp8 quant vs unfused", rows=rows, rel_err=0.0 if same else 1.0,
                    ok=same))  # fmt: skip
    y = torch._scaled_mm(q, w8.data.t(), scale_a=scale, scale_b=w8.scale.view(1, -1), out_dtype=torch.bfloat16,
                         use_fast_accum=True)  # fmt: skip
    ref = (q.float() * scale) @ (w8.data.float() * w8.scale[:, None]).T
    err = rel_err(y, ref)
    out.append(dict(shape=f"{n}x{k}", fmt="fp8 _scaled_mm fast accum", rows=rows, rel_err=err, ok=err <= 1e-2))
    for check in out:
        log(f"{'PASS' if check['ok'] else 'FAIL'} {check['fmt']} {check['rows']} rows: rel err {check['rel_err']:.2e}")
    return out


def split_k_checks(n: int = 6144, k: int = 4096, repeats: int = 200) -> list[dict]:
    """The int4 split-K reduction on the GPU (its counters and barriers order real concurrent programs, which
    the CPU interpreter runs one after another): 200 launches in a row at 1 and 8 rows must all give the same
    bits (the partials are added in split order), match the reference, and leave the counters at zero."""
    out = []
    w = make_weight("int4", n, k)
    case = GemvCase(k)
    for split_k in (2, 4):
        for rows in (1, max(MULTI_ROWS)):
            config = GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=1, split_k=split_k)
            first = case.run(w, PROLOGUE_RMSNORM, rows, config)
            same = all(torch.equal(case.run(w, PROLOGUE_RMSNORM, rows, config), first) for _ in range(repeats))
            err = rel_err(first, case.ref(w, PROLOGUE_RMSNORM, rows))
            zeroed = not split_k_counters(first.device, 1).any().item()
            ok = same and zeroed and err <= 1e-2
            out.append(dict(shape=f"{n}x{k}", fmt=f"int4 split_k={split_k}", rows=rows, rel_err=err, ok=ok,
                            deterministic=same, counters_zero=zeroed))  # fmt: skip
            log(f"{'PASS' if ok else 'FAIL'} int4 split_k={split_k} {rows} row(s): rel err {err:.2e}, {repeats} launches "
                f"{'identical' if same else 'DIFFER'}, counters {'zero' if zeroed else 'NOT ZERO'}")  # fmt: skip
    return out


def summarize(report: dict) -> dict:
    """The numbers the issue's targets name, in one block at the end of the output (and the JSON's "summary")."""
    out: dict = {}
    steps = report.get("steps", {})
    base = steps.get("bf16")
    targets = {"fp8": ("b1 <= 0.65x", "64 rows >= 1.3x"), "w4a16_int4": ("b1 <= 0.45x", "")}
    for scheme, row in steps.items():
        if base is None:
            break
        ratios = dict(b1=row["b1_ms"] / base["b1_ms"], b8=row["b8_ms"] / base["b8_ms"],
                      b64_tok_s=row["b64_tok_s"] / base["b64_tok_s"])  # fmt: skip
        out[f"steps {scheme}"] = dict(b1_ms=row["b1_ms"], **ratios)
        log(f"SUMMARY steps {scheme:10s} b1 {row['b1_ms']:.3f} ms ({ratios['b1']:.2f}x bf16), b8 {ratios['b8']:.2f}x, "
            f"64 rows {ratios['b64_tok_s']:.2f}x bf16 tok/s  {' '.join(targets.get(scheme, ()))}")  # fmt: skip
    for case in report.get("int4_sweep", {}).get("cases", []):
        key = f"int4 gemv {case['shape']} {case['rows']} row(s)"
        out[key] = dict(default_pct_bw=case["default_pct_bw"], best_pct_bw=case["best_pct_bw"], best=case["best"])
        log(f"SUMMARY {key:32s} default {case['default_pct_bw']:3.0f}% of copy BW, best {case['best_pct_bw']:3.0f}%")
    checks = report.get("kernels", {}).get("checks", [])
    failed = [c for c in checks if not c["ok"]]
    out["gpu_checks_failed"] = len(failed)
    log(f"SUMMARY GPU correctness checks: {len(checks) - len(failed)} passed, {len(failed)} failed {failed or ''}")
    for row in report.get("attention_32k", []):
        if row["kernel"] == "as the model runs":
            out[f"attention 32k b{row['batch']} {row['kv']} ms"] = row["ms"]
    for batch in (1, 8):
        bf16, fp8 = out.get(f"attention 32k b{batch} bf16 ms"), out.get(f"attention 32k b{batch} fp8 ms")
        if bf16 and fp8:
            log(f"SUMMARY decode attention 32k batch {batch}: FP8 KV {bf16 / fp8:.2f}x bf16 KV (target >= 1.6x)")
    if "kv_capacity" in report:
        log(f"SUMMARY KV slots FP8 / bf16: {report['kv_capacity']['ratio']:.2f}x (target >= 1.9x)")
    return out


def install_tuned(report: dict) -> None:
    """The sweeps' best configs into tgi_compat.kernels.gemv.tuned's tables, so the decode steps below run them."""
    gemv_tuned.TUNED_ROW_SCALED.update(report.get("kernels", {}).get("tuned_row_scaled", {}))
    gemv_tuned.TUNED_INT4.update(report.get("int4_sweep", {}).get("tuned", {}))
    log(f"decode steps run {len(gemv_tuned.TUNED_ROW_SCALED)} tuned fp8/int8 and {len(gemv_tuned.TUNED_INT4)} "
        f"tuned int4 GEMV configs")  # fmt: skip


def jsonable(value):
    """The report with tuple keys as strings and configs as dicts."""
    if isinstance(value, dict):
        return {str(k) if isinstance(k, tuple) else k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, GemvConfig):
        return dataclasses.asdict(value)
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_quant.json"))
    parser.add_argument("--no-sweep", action="store_true", help="skip the GEMV config sweeps")
    parser.add_argument("--int4-budget-s", type=float, default=150.0, help="time for the int4 GEMV sweep")
    parser.add_argument("--time-limit-s", type=float, default=540.0, help="skip the attention / kv parts past it")
    parser.add_argument("--multi-rows", action="store_true", help="time the FP8/int8/int4 GEMVs at 2, 4, 8 rows too")
    parser.add_argument("--parts", default="kernels,steps,attention,kv", help="comma-separated subset to run")
    parser.add_argument("--schemes", default="bf16,fp8,eetq,w4a16_int4", help="the decode steps' schemes (bf16 always)")
    parser.add_argument("--profile-b1", action="store_true", help="the steps' batch-1 GPU time per kernel")
    parser.add_argument("--fp8-tuned", help="bench_fp8_gemm.py's --tuned-out file, installed before the steps")
    args = parser.parse_args()
    if args.fp8_tuned:
        from bench_fp8_gemm import install_tuned as install_fp8_gemm_tuned

        install_fp8_gemm_tuned(args.fp8_tuned)
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    started = time.monotonic()
    bandwidth = copy_bandwidth()
    report = {"gpu": torch.cuda.get_device_name(), "copy_bw_gbs": bandwidth / 1e9}
    log(f"{report['gpu']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")

    def save(part: str) -> None:  # after every part, so a run cut short keeps what it measured
        log(f"[{part} done at {time.monotonic() - started:.0f} s]")
        with open(args.json, "w") as f:
            json.dump(jsonable(report), f, indent=1)

    if "kernels" in parts:
        report["kernels"] = gemv_kernels(bandwidth, sweep=not args.no_sweep, multi_rows=args.multi_rows)
        save("kernels")
        if not args.no_sweep:
            report["int4_sweep"] = int4_sweep(bandwidth, args.int4_budget_s)
            save("int4 sweep")
        install_tuned(report)
    if "int4_one_row" in parts:
        report["int4_one_row"] = int4_one_row(bandwidth, args.int4_budget_s)
        save("int4 one-row")
    if "gemlite" in parts:
        report["gemlite"] = gemlite_rows(bandwidth)
        save("gemlite")
    if parts & {"steps", "kv"}:
        model, hf_config = hf_model(LLAMA3_8B, torch.bfloat16)
        state_dict = {name: t for name, t in model.state_dict().items()}
    if "steps" in parts:
        report["steps"] = {}
        for scheme in SCHEMES:
            if scheme == "w4a16_int4" and "int4_one_row" in report:  # the fastest one-row config of each shape
                gemv_tuned.TUNED_INT4.update(report["int4_one_row"]["tuned"])
            if scheme is None or scheme in args.schemes.split(","):  # bf16 always: the ratios' base
                report["steps"][scheme or "bf16"] = decode_steps(hf_config, state_dict, scheme, args.profile_b1)
            save(f"steps {scheme or 'bf16'}")
        base = report["steps"]["bf16"]
        for scheme, row in report["steps"].items():
            log(f"{scheme:>10}: batch 1 {row['b1_ms'] / base['b1_ms']:.2f}x bf16 time, batch 8 "
                f"{row['b8_ms'] / base['b8_ms']:.2f}x, batch 64 {row['b64_tok_s'] / base['b64_tok_s']:.2f}x bf16 throughput")  # fmt: skip
        report["summary"] = summarize(report)  # printed now too, in case the parts below run out of time

    def time_left_for(part: str, seconds: float) -> bool:  # the last parts are skipped rather than cut
        left = args.time_limit_s - (time.monotonic() - started)
        if left < seconds:
            log(f"[{part} skipped: {left:.0f} s left of --time-limit-s, it takes ~{seconds:.0f} s]")
        return left >= seconds

    if "attention" in parts and time_left_for("attention", 60):
        report["attention_32k"] = attention_32k(bandwidth)
        save("attention")
    if "kv" in parts and time_left_for("kv", 45):
        report["kv_capacity"] = kv_capacity(hf_config, state_dict)
        save("kv")
    report["summary"] = summarize(report)
    save("summary")


if __name__ == "__main__":
    main()
