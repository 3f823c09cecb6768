"""Batch-1 bf16 GEMV: correctness at real shapes, a config sweep, fused vs unfused (writes $OUT/gemv.json).

    python3 -m benchmarks.device.tune_gemv [--quick] [--shapes "llama3-8b qkv,llama3-8b o" | --shapes tp]

Every decode projection of Llama-3-8B, Qwen2-7B and Gemma-2-9B at one row (`--shapes tp`: one rank's shard of
Llama-3-8B at --num-shard 2 and of Llama-3-70B at 4):
  1. tgi_compat.kernels.gemv.gemv against gemv_ref on fresh random data, with each prologue;
  2. cuBLAS (F.linear) time and the best config of the sweep, as % of the copy bandwidth, beside what the model
     runs now (the TUNED entry and the rule of thumb);
  3. the unfused pair (norm kernel + F.linear, silu_mul + F.linear) against the fused kernel.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from benchmarks.device.gemv_cases import PROLOGUE_NAMES, PROLOGUES, GemvCase, rel_err, weight_copies
from benchmarks.device.timing import copy_bandwidth, device_info, log, out_path, replay_us, write_json
from benchmarks.shapes import MODELS, projections
from tgi_compat.kernels.elementwise.rmsnorm import norm_add_rmsnorm, rmsnorm
from tgi_compat.kernels.elementwise.silu_mul import silu_mul
from tgi_compat.kernels.gemv.config import rule_of_thumb_config
from tgi_compat.kernels.gemv.tuned import TUNED
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_NONE,
    PROLOGUE_NORM_ADD_NORM,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    GemvConfig,
)

# (model, shards, projections): one rank's shapes of each
MATMULS = [
    ("llama3-8b", 1, ("qkv", "o", "gate_up", "down", "lm_head")),
    ("qwen2-7b", 1, ("qkv", "o", "gate_up", "down")),
    ("gemma2-9b", 1, ("qkv", "o", "gate_up")),
    ("llama3-8b", 2, ("qkv", "o", "gate_up", "down", "lm_head")),
    ("llama3-70b", 4, ("qkv", "o", "gate_up", "down", "lm_head")),
]


def shape_table() -> dict[str, tuple[int, int, int]]:
    """ "llama3-8b qkv" (or "llama3-8b/tp2 qkv"): (N, K, the prologue the model fuses into it)."""
    table = {}
    for model, shards, names in MATMULS:
        shapes = projections(MODELS[model], shards)
        for name in names:
            prologue = PROLOGUES.get(name, PROLOGUE_NONE)
            if model.startswith("gemma2") and prologue == PROLOGUE_RMSNORM:
                prologue = PROLOGUE_NORM_ADD_NORM  # Gemma's sandwich norms
            table[f"{model}{f'/tp{shards}' if shards > 1 else ''} {name}"] = (*shapes[name], prologue)
    return table


SHAPES = shape_table()


def check_correctness() -> list[dict]:
    rows = []
    for name, (n, k, _) in SHAPES.items():
        w, case = weight_copies("bf16", n, k)[0], GemvCase(k)
        for prologue, case_name in PROLOGUE_NAMES.items():
            err = rel_err(case.run(w, prologue), case.ref(w, prologue))
            rows.append(dict(shape=name, case=case_name, rel_err=err, ok=err <= 1e-2))
            log(f"{'PASS' if err <= 1e-2 else 'FAIL'} {name:18s} {case_name:17s} rel err {err:.2e}")
            if prologue == PROLOGUE_RMSNORM:  # and the x + residual it hands on, to the bit
                expected = (case.x[:1, :k].float() + case.residual[:1].float()).to(torch.bfloat16)
                sum_err = rel_err(case.summed[:1], expected)
                rows.append(dict(shape=name, case="residual sum", rel_err=sum_err, ok=sum_err == 0))
    return rows


def sweep(quick: bool) -> list[GemvConfig]:
    block_n = (4, 8, 16) if quick else (2, 4, 8, 16, 32)
    # the quick grid keeps 1,024-wide K tiles: the rule of thumb's, which beat every quick config at the shard shapes
    block_k = (512, 1024) if quick else (128, 256, 512, 1024)
    warps = (4, 8)
    stages = (1, 3) if quick else (1, 2, 4)
    return [GemvConfig(*c) for c in itertools.product(block_n, block_k, warps, stages) if c[0] * c[1] <= 16384]


def unfused(case: GemvCase, prologue: int):
    """The pair the model would run without the fused prologue: its norm or activation kernel, then cuBLAS."""
    x, kwargs = case.args(prologue, 1)
    if prologue == PROLOGUE_SILU_MUL:
        return lambda w: F.linear(silu_mul(x), w)
    if prologue == PROLOGUE_RMSNORM:
        return lambda w: F.linear(
            rmsnorm(x, kwargs["norm_weight"], 1e-5, residual=kwargs["residual"], residual_out=case.summed[:1]), w
        )
    if prologue == PROLOGUE_NORM_ADD_NORM:
        norm, residual, x_norm = kwargs["norm_weight"], kwargs["residual"], kwargs["x_norm_weight"]
        return lambda w: F.linear(
            norm_add_rmsnorm(x, x_norm, 1e-6, residual, norm, 1e-5, residual_out=case.summed[:1]), w
        )
    return lambda w: F.linear(x, w)


def bench_shape(name: str, configs: list[GemvConfig], bandwidth: float) -> dict:
    n, k, prologue = SHAPES[name]
    weights, case = weight_copies("bf16", n, k), GemvCase(k)

    def fused_us(cfg: GemvConfig) -> float:
        return replay_us([lambda w=w: case.run(w, prologue, 1, cfg) for w in weights])

    floor_us = n * k * 2 / bandwidth * 1e6
    cublas = replay_us([lambda w=w: F.linear(case.x[:1, :k], w) for w in weights])
    pair = unfused(case, prologue)
    baseline = replay_us([lambda w=w: pair(w) for w in weights])
    timed = []
    for cfg in configs:
        try:
            timed.append((fused_us(cfg), cfg))
        except Exception as exc:  # a config Triton cannot build (registers, smem)
            log(f"  {cfg} failed: {type(exc).__name__}")
    timed.sort(key=lambda t: t[0])
    best_us, best = timed[0]
    # what the model runs today: the TUNED entry (if any) and the rule of thumb it replaces
    chosen = {"tuned": TUNED.get((n, k, prologue)), "rule": rule_of_thumb_config(k, prologue)}
    current = {label: fused_us(cfg) for label, cfg in chosen.items() if cfg is not None}
    row = dict(shape=name, n=n, k=k, prologue=PROLOGUE_NAMES[prologue], floor_us=floor_us, cublas_us=cublas)
    row |= dict(unfused_us=baseline, fused_us=best_us, best=best.__dict__, current_us=current)
    row["top5"] = [dict(us=u, **c.__dict__) for u, c in timed[:5]]
    log(
        f"{name:18s} {row['prologue']:8s} floor {floor_us:6.1f} us | cuBLAS {cublas:6.1f} | unfused {baseline:6.1f} | "
        f"fused {best_us:6.1f} ({100 * floor_us / best_us:5.1f}% of copy BW) {best}; "
        + ", ".join(f"{label} {us:.1f}" for label, us in current.items())
    )
    for us, cfg in timed[1:5]:
        log(f"    {us:6.1f} {cfg}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller config grid")
    parser.add_argument("--shapes", default="", help="comma-separated shape names; 'tp': the tensor-parallel shards'")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    result = dict(device_info(bandwidth), correctness=check_correctness())
    wanted = [s for s in args.shapes.split(",") if s] or [name for name in SHAPES if "/tp" not in name]
    if wanted == ["tp"]:
        wanted = [name for name in SHAPES if "/tp" in name]
    result["shapes"] = [bench_shape(name, sweep(args.quick), bandwidth) for name in wanted]
    write_json(out_path("gemv.json"), result)
    failed = [r for r in result["correctness"] if not r["ok"]]
    log(f"correctness: {len(failed)} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
