"""Batch-1 GEMV on the GPU (not CI): correctness at real shapes, a config sweep, fused vs unfused.

    python3 scripts/device/tune_gemv.py [--quick]     (repo root on the device; writes $OUT/gemv.json)

For every projection of Llama-3-8B, Qwen2-7B and Gemma-2-9B at one row, bf16 (or, with --shapes tp, of one
rank's shard of Llama-3-8B at --num-shard 2 and of Llama-3-70B at 4):
  1. tgi_compat.kernels.gemv.gemv against gemv_ref on fresh random data (plain, RMSNorm+residual, SiLU-mul, Gemma's
     norm-add-norm prologues);
  2. cuBLAS (F.linear) time and the best tgi_compat.kernels.gemv.gemv config, as % of the copy bandwidth;
  3. the unfused pair (rmsnorm kernel + F.linear, silu_mul + F.linear, norm_add_rmsnorm + F.linear) against
     the fused kernel.
Times are CUDA-graph replays over enough weight copies (> 4x L2) that no weight is read from L2, as
in a real step where each layer's weights are read once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

# eager, as in the other scripts: a copy captured in a graph read 2,709 GB/s on an H200
from bench_gpu import copy_bandwidth

from tgi_compat.kernels.elementwise.rmsnorm import norm_add_rmsnorm, rmsnorm
from tgi_compat.kernels.elementwise.silu_mul import silu_mul
from tgi_compat.kernels.gemv.config import rule_of_thumb_config
from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.tuned import TUNED
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_NONE,
    PROLOGUE_NORM_ADD_NORM,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    GemvConfig,
)

DEV = "cuda"
DTYPE = torch.bfloat16
SHAPES = {  # name: (N, K, the prologue the model fuses into this projection)
    "llama3-8b qkv": (6144, 4096, "rmsnorm"),
    "llama3-8b o": (4096, 4096, "plain"),
    "llama3-8b gate_up": (28672, 4096, "rmsnorm"),
    "llama3-8b down": (4096, 14336, "silu_mul"),
    "llama3-8b lm_head": (128256, 4096, "plain"),
    "qwen2-7b qkv": (4608, 3584, "rmsnorm"),
    "qwen2-7b o": (3584, 3584, "plain"),
    "qwen2-7b gate_up": (37888, 3584, "rmsnorm"),
    "qwen2-7b down": (3584, 18944, "silu_mul"),
    "gemma2-9b qkv": (8192, 3584, "norm_add_norm"),
    "gemma2-9b o": (3584, 4096, "plain"),
    "gemma2-9b gate_up": (28672, 3584, "norm_add_norm"),
    # one rank's shards under tensor parallelism (--shapes tp: these alone)
    "llama3-8b/tp2 qkv": (3072, 4096, "rmsnorm"),
    "llama3-8b/tp2 o": (4096, 2048, "plain"),
    "llama3-8b/tp2 gate_up": (14336, 4096, "rmsnorm"),
    "llama3-8b/tp2 down": (4096, 7168, "silu_mul"),
    "llama3-8b/tp2 lm_head": (64128, 4096, "plain"),
    "llama3-70b/tp4 qkv": (2560, 8192, "rmsnorm"),
    "llama3-70b/tp4 o": (8192, 2048, "plain"),
    "llama3-70b/tp4 gate_up": (14336, 8192, "rmsnorm"),
    "llama3-70b/tp4 down": (8192, 7168, "silu_mul"),
    "llama3-70b/tp4 lm_head": (32064, 8192, "plain"),
}


PROLOGUE_CODES = {
    "plain": PROLOGUE_NONE,
    "rmsnorm": PROLOGUE_RMSNORM,
    "norm_add_norm": PROLOGUE_NORM_ADD_NORM,
    "silu_mul": PROLOGUE_SILU_MUL,
}


def log(msg: str) -> None:
    print(msg, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def graph_us(calls: list, reps: int = 20) -> float:
    """Microseconds per call: one CUDA graph holding every call (each on its own weight copy)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(calls)


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    count = max(2, -(-200_000_000 // (n * k * 2)))
    return [torch.randn(n, k, device=DEV, dtype=DTYPE) / k**0.5 for _ in range(count)]


def check_correctness() -> list[dict]:
    rows, gen = [], torch.Generator(device=DEV).manual_seed(0)
    for name, (n, k, _) in SHAPES.items():
        w = torch.randn(n, k, device=DEV, dtype=DTYPE, generator=gen) / k**0.5
        x = torch.randn(1, k, device=DEV, dtype=DTYPE, generator=gen)
        res = torch.randn(1, k, device=DEV, dtype=DTYPE, generator=gen)
        nw = 1 + 0.1 * torch.randn(k, device=DEV, dtype=DTYPE, generator=gen)
        summed = torch.empty_like(res)
        cases = {
            "plain": (gemv(x, w), gemv_ref(x, w)[0]),
            "rmsnorm+residual": (
                gemv(x, w, norm_weight=nw, eps=1e-5, residual=res, residual_out=summed),
                gemv_ref(x, w, norm_weight=nw, eps=1e-5, residual=res)[0],
            ),
        }
        norm_add_norm = dict(norm_weight=nw, eps=1e-6, residual=res, x_norm_weight=nw.flip(0), x_eps=1e-6)
        cases["norm_add_norm"] = (
            gemv(8 * x, w, residual_out=torch.empty_like(res), **norm_add_norm),
            gemv_ref(8 * x, w, **norm_add_norm)[0],
        )
        gate_up = torch.randn(1, 2 * k, device=DEV, dtype=DTYPE, generator=gen)
        cases["silu_mul"] = (gemv(gate_up, w, silu_mul=True), gemv_ref(gate_up, w, silu_mul=True)[0])
        for case, (out, ref) in cases.items():
            err = rel_err(out, ref)
            ok = err <= 1e-2
            rows.append(dict(shape=name, case=case, rel_err=err, ok=ok))
            log(f"{'PASS' if ok else 'FAIL'} {name:18s} {case:17s} rel err {err:.2e}")
        sum_err = rel_err(summed, (x.float() + res.float()).to(DTYPE))
        rows.append(dict(shape=name, case="residual sum", rel_err=sum_err, ok=sum_err == 0))
    return rows


def sweep(quick: bool) -> list[GemvConfig]:
    block_n = (4, 8, 16) if quick else (2, 4, 8, 16, 32)
    # the quick grid keeps 1,024-wide K tiles: the rule of thumb's, which beat every quick config at the shard shapes
    block_k = (512, 1024) if quick else (128, 256, 512, 1024)
    warps = (4, 8)
    stages = (1, 3) if quick else (1, 2, 4)
    return [GemvConfig(*c) for c in itertools.product(block_n, block_k, warps, stages) if c[0] * c[1] <= 16384]


def bench_shape(name: str, n: int, k: int, prologue: str, configs: list[GemvConfig], bandwidth: float) -> dict:
    """The unfused pair the model runs without tgi_compat.kernels.gemv.gemv against the best fused config."""
    weights = weight_copies(n, k)
    x = torch.randn(1, k, device=DEV, dtype=DTYPE)
    res, nw = torch.randn(1, k, device=DEV, dtype=DTYPE), torch.ones(k, device=DEV, dtype=DTYPE)
    summed = torch.empty_like(res)
    gate_up = torch.randn(1, 2 * k, device=DEV, dtype=DTYPE)
    if prologue == "rmsnorm":

        def unfused(w):
            return F.linear(rmsnorm(x, nw, 1e-5, residual=res, residual_out=summed), w)

        def fused(w, cfg):
            return gemv(x, w, norm_weight=nw, eps=1e-5, residual=res, residual_out=summed, config=cfg)
    elif prologue == "norm_add_norm":

        def unfused(w):
            return F.linear(norm_add_rmsnorm(x, nw, 1e-6, res, nw, 1e-6, residual_out=summed), w)

        def fused(w, cfg):
            return gemv(
                x, w, norm_weight=nw, eps=1e-6, residual=res, residual_out=summed, x_norm_weight=nw, x_eps=1e-6,
                config=cfg,
            )  # fmt: skip
    elif prologue == "silu_mul":

        def unfused(w):
            return F.linear(silu_mul(gate_up), w)

        def fused(w, cfg):
            return gemv(gate_up, w, silu_mul=True, config=cfg)
    else:

        def unfused(w):
            return F.linear(x, w)

        def fused(w, cfg):
            return gemv(x, w, config=cfg)

    floor_us = n * k * 2 / bandwidth * 1e6
    cublas = graph_us([lambda w=w: F.linear(x, w) for w in weights])
    baseline = graph_us([lambda w=w: unfused(w) for w in weights])
    timed = []
    for cfg in configs:
        try:
            timed.append((graph_us([lambda w=w, cfg=cfg: fused(w, cfg) for w in weights]), cfg))
        except Exception as exc:  # a config Triton cannot build (registers, smem)
            log(f"  {cfg} failed: {type(exc).__name__}")
    timed.sort(key=lambda t: t[0])
    best_us, best = timed[0]
    # what the model runs today: the TUNED entry (if any) and the rule of thumb it replaces
    code = PROLOGUE_CODES[prologue]
    chosen = {"tuned": TUNED.get((n, k, code)), "rule": rule_of_thumb_config(k, code)}
    current = {
        label: graph_us([lambda w=w, cfg=cfg: fused(w, cfg) for w in weights])
        for label, cfg in chosen.items()
        if cfg is not None
    }
    row = dict(
        shape=name,
        n=n,
        k=k,
        prologue=prologue,
        floor_us=floor_us,
        cublas_us=cublas,
        unfused_us=baseline,
        fused_us=best_us,
        best=best.__dict__,
        top5=[dict(us=u, **c.__dict__) for u, c in timed[:5]],
        current_us=current,
    )
    log(
        f"{name:18s} {prologue:8s} floor {floor_us:6.1f} us | cuBLAS {cublas:6.1f} | unfused {baseline:6.1f} | "
        f"fused {best_us:6.1f} ({100 * floor_us / best_us:5.1f}% of copy BW) {best}; "
        + ", ".join(f"{label} {us:.1f}" for label, us in current.items())
    )
    for us, cfg in timed[1:5]:
        log(f"    {us:6.1f} {cfg}")
    del weights
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smaller config grid")
    parser.add_argument(
        "--shapes", default="", help="comma-separated subset of shape names; 'tp': the tensor-parallel shards'"
    )
    args = parser.parse_args()
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    result = dict(device=torch.cuda.get_device_name(), correctness=check_correctness())
    bandwidth = copy_bandwidth()
    result["copy_gb_s"] = bandwidth / 1e9
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    configs = sweep(args.quick)
    wanted = [s for s in args.shapes.split(",") if s] or [name for name in SHAPES if "/tp" not in name]
    if wanted == ["tp"]:
        wanted = [name for name in SHAPES if "/tp" in name]
    result["shapes"] = [bench_shape(name, *SHAPES[name], configs, bandwidth) for name in wanted]
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gemv.json"), "w") as f:
        json.dump(result, f, indent=1)
    failed = [r for r in result["correctness"] if not r["ok"]]
    log(f"correctness: {len(failed)} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
