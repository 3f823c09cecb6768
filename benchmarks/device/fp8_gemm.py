"""The skinny FP8 GEMM (tgi_compat/kernels/fp8_gemm.py) against `torch._scaled_mm` at decode widths (not CI), < 3 min on an H100:

    python3 -m benchmarks.device.fp8_gemm [--json $OUT/bench_fp8_gemm.json] [--tuned-out $OUT/fp8_gemm_tuned.json]

Llama-3-8B's four projections (q|k|v 6144x4096, o 4096x4096, gate|up 28672x4096, down 4096x14336) at 16, 32 and 64
rows of FP8 activations: `_scaled_mm` as tgi_compat/modeling/layers/quantization/fp8.py calls it (row-wise scales, fast
accumulation), tgi_compat.kernels.quant.fp8_gemm at its default config and at every config of a small sweep. Each config's output is
checked against the float32 reference first (relative error < 1e-2); a miss is reported and not timed. Times are
do_bench medians of CUDA-graph replays; GB/s counts weight + activation + output bytes, as % of the measured copy
bandwidth. The best config per (row bucket, N, K) is printed as a `TUNED` literal for tgi_compat/kernels/fp8_gemm.py and written
to --tuned-out, which `benchmarks.device.quant --fp8-tuned FILE` installs before its decode steps.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.runtime.errors import OutOfResources

import tgi_compat.kernels.quant.fp8_gemm as fp8_gemm_module
from benchmarks.device.gemv_cases import rel_err
from benchmarks.device.timing import copy_bandwidth, device_info, graph_ms, log, out_path, pct_of, write_json
from benchmarks.shapes import LLAMA3_8B, projections
from tgi_compat.kernels.quant.fp8_gemm import Fp8GemmConfig, fp8_gemm, fp8_gemm_config, fp8_gemm_ref, row_bucket
from tgi_compat.kernels.quant.per_token import quant_per_token
from tgi_compat.modeling.layers.quantization.fp8 import quantize_weight_per_channel

SHAPES = {name: nk for name, nk in projections(LLAMA3_8B).items() if name != "lm_head"}
ROWS = (16, 32, 64)  # tgi_compat.kernels.quant.fp8_gemm.MAX_ROWS and below
# (block_n, block_k, num_stages, split_k): the first sweep's winners were BLOCK_K 256 at 4 stages, and 128 at 3
# for gate|up; split-K for the narrow-N projections (o, down), whose N / BLOCK_N programs leave SMs idle.
SWEEP = [(bn, bk, 4, st, sk) for bn in (32, 64, 128) for bk, st in ((128, 3), (256, 4)) for sk in (1, 2, 4)]
# At 64 rows (the throughput target's width) the narrow projections read at 31-43% of copy bandwidth with the grid
# above: more bytes in flight a program (8 warps, 512-wide K tiles, a fifth stage) or more programs (16 rows).
SWEEP_64_ROWS = [(32, 256, 8, 4, 1), (64, 256, 8, 4, 1), (64, 256, 8, 3, 2), (32, 512, 4, 3, 1), (64, 512, 8, 3, 1)]
SWEEP_64_ROWS += [(16, 256, 4, 4, 1), (16, 256, 4, 5, 1), (32, 256, 4, 5, 1)]


# Tiles through TMA descriptors (tgi_compat.kernels.quant.fp8_gemm `tma`): the copies need no threads, so deeper pipelines fit.
# The last line is for gate|up (67% of copy bandwidth at 64 rows with pointer loads; no TMA config of the first
# line beat them there): 128-wide K tiles, which it preferred, at every N width and 4-6 stages.
SWEEP_TMA = [(32, 256, 4, 4, 1), (64, 256, 4, 4, 1), (32, 256, 4, 6, 1), (64, 256, 8, 5, 1), (32, 128, 4, 8, 1)]
SWEEP_TMA += [(64, 128, 4, 6, 2), (128, 256, 8, 3, 2), (64, 256, 4, 4, 4)]
SWEEP_TMA += [(32, 128, 4, 6, 1), (64, 128, 4, 4, 1), (64, 128, 4, 5, 1), (64, 128, 8, 6, 1), (128, 128, 8, 4, 1)]


def sweep(num_rows: int) -> list[Fp8GemmConfig]:
    """One row tile per config (BLOCK_M = the row bucket, at most 64): each reads the weight once."""
    block_m = min(row_bucket(num_rows), 64)
    grid = SWEEP + (SWEEP_64_ROWS if block_m == 64 else [])
    pointer_loads = [Fp8GemmConfig(block_m, bn, bk, warps, st, sk) for bn, bk, warps, st, sk in grid]
    tma = [Fp8GemmConfig(block_m, bn, bk, warps, st, sk, tma=True) for bn, bk, warps, st, sk in SWEEP_TMA]
    return pointer_loads + tma


def install_tuned(path: str) -> None:
    """A --tuned-out file's configs into tgi_compat.kernels.quant.fp8_gemm.TUNED (for benchmarks.device.quant's steps)."""
    with open(path) as f:
        tuned = json.load(f)
    for key, config in tuned.items():
        bucket, n, k = (int(v) for v in key.split(","))
        fp8_gemm_module.TUNED[(bucket, n, k)] = Fp8GemmConfig(*config)
    log(f"installed {len(tuned)} tuned FP8 GEMM configs from {path}")


def scaled_mm_ms(x_q, x_scale, weight, weight_scale) -> float:
    """`_scaled_mm` as tgi_compat/modeling/layers/quantization/fp8.py calls it."""
    scale_b = weight_scale.view(1, -1)
    return graph_ms(
        lambda: torch._scaled_mm(
            x_q, weight.t(), scale_a=x_scale, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=True
        )
    )


def bench_shape(name: str, n: int, k: int, num_rows: int, bandwidth: float) -> tuple[dict, int]:
    """_scaled_mm, the default config and every correct config of the sweep at one shape: (row, misses)."""
    weight, weight_scale = quantize_weight_per_channel(torch.randn(n, k, device="cuda") / 64)
    x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_scale = quant_per_token(x, torch.float8_e4m3fn)
    ref = fp8_gemm_ref(x_q, x_scale, weight, weight_scale)
    moved = n * k + num_rows * k + 2 * num_rows * n  # fp8 weight and input, bf16 output
    default, misses = fp8_gemm_config(num_rows, n, k), 0
    timed = {"scaled_mm": scaled_mm_ms(x_q, x_scale, weight, weight_scale)}
    for config in dict.fromkeys([default, *sweep(num_rows)]):
        try:
            err = rel_err(fp8_gemm(x_q, x_scale, weight, weight_scale, config=config), ref)
        except OutOfResources as exc:  # a config past the card's shared memory: skipped, not fatal
            log(f"SKIP {name} {num_rows} rows {tuple(config)}: {exc}")
            continue
        if not err < 1e-2:
            misses += 1
            log(f"MISS {name} {num_rows} rows {tuple(config)}: rel err {err:.2e}")
            continue
        timed[config] = graph_ms(lambda config=config: fp8_gemm(x_q, x_scale, weight, weight_scale, config=config))
    best = min((c for c in timed if c != "scaled_mm"), key=timed.__getitem__)
    row = dict(shape=name, rows=num_rows, n=n, k=k, default=list(default), best=list(best))
    for label, config in (("scaled_mm", "scaled_mm"), ("default", default), ("best", best)):
        ms = timed.get(config, float("nan"))
        row |= {f"{label}_us": 1e3 * ms, f"{label}_pct_bw": pct_of(bandwidth, moved, ms)}
    row["best_vs_scaled_mm"] = timed["scaled_mm"] / timed[best]
    log(json.dumps(row))
    return row, misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=out_path("bench_fp8_gemm.json"))
    parser.add_argument("--tuned-out", default=out_path("fp8_gemm_tuned.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    report = device_info(bandwidth)
    rows, misses = [], 0
    for (name, (n, k)), num_rows in itertools.product(SHAPES.items(), ROWS):
        row, row_misses = bench_shape(name, n, k, num_rows, bandwidth)
        rows.append(row)
        misses += row_misses
    tuned = {f"{row_bucket(r['rows'])},{r['n']},{r['k']}": r["best"] for r in rows}
    write_json(args.json, report | {"rows": rows, "misses": misses})
    write_json(args.tuned_out, tuned)
    log("TUNED = {")
    for key, config in tuned.items():
        log(f"    ({key}): Fp8GemmConfig{tuple(config)},")
    log("}")
    log(
        f"{'shape':>8} {'rows':>4} | {'_scaled_mm us (%bw)':>20} | {'default us (%bw)':>18} | {'best us (%bw)':>16} | x"
    )
    for r in rows:
        cells = [
            f"{r[f'{label}_us']:>9.1f} ({r[f'{label}_pct_bw']:>4.0f}%)" for label in ("scaled_mm", "default", "best")
        ]
        log(f"{r['shape']:>8} {r['rows']:>4} | " + " | ".join(cells) + f" | {r['best_vs_scaled_mm']:.2f}")
    log(f"correctness misses: {misses}")


if __name__ == "__main__":
    main()
