"""bf16 GEMMs at decode widths on Llama-3-8B's projections at one and two shards (not CI), ~1.5 min on an H200:

    PYTHONPATH=$PWD python3 scripts/device/probe_skinny_bf16_gemm.py [--rows 64] [--json $OUT/skinny_bf16.json]

What a tensor-parallel decode step's matmuls could gain: cuBLAS as the model calls it (F.linear), with
`allow_bf16_reduced_precision_reduction` flipped, through cuBLASLt (`preferred_blas_library`), with the rows padded
to 80 / 96 / 128 (cuBLAS picks other tiles there), and the Triton skinny GEMM of tgi_compat/kernels/quant/fp8_gemm.py fed bf16
with unit scales over a config sweep (two-shard shapes only). Times are do_bench medians of one-kernel CUDA-graph
replays with a cold L2 (so they carry a graph launch each and read above the in-model times); % of copy bandwidth
counts weight + activation + output bytes. Each Triton config's output is checked against float32 first.
"""

# ruff: noqa: B023  (each lambda is timed inside the loop iteration that defines it)

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(__file__))

from bench_gpu import copy_bandwidth, graph_ms, log
from tune_gemv import rel_err

from tgi_compat.kernels.quant.fp8_gemm import Fp8GemmConfig, fp8_gemm

SHAPES = {
    "tp2_qkv": (3072, 4096), "tp2_o": (4096, 2048), "tp2_gate_up": (14336, 4096), "tp2_down": (4096, 7168),
    "tp1_qkv": (6144, 4096), "tp1_o": (4096, 4096), "tp1_gate_up": (28672, 4096), "tp1_down": (4096, 14336),
}  # fmt: skip
SHARED_MEMORY_BYTES = 200_000  # configs whose pipelined tiles need more are skipped


def triton_configs(rows: int) -> list[Fp8GemmConfig]:
    grid = itertools.product((32, 64, 128), (64, 128), (3, 5), (1, 2, 4), (False, True))
    block_m = 64 if rows >= 64 else 32
    return [
        Fp8GemmConfig(block_m, block_n, block_k, 4, stages, split_k, tma)
        for block_n, block_k, stages, split_k, tma in grid
        if 2 * stages * block_k * (block_n + block_m) <= SHARED_MEMORY_BYTES
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "skinny_bf16.json"))
    args = parser.parse_args()
    rows = args.rows
    bandwidth = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, {rows} rows")
    matmul = torch.backends.cuda.matmul
    report = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        row: dict = {"shape": name, "n": n, "k": k}
        row["cublas_us"] = 1e3 * graph_ms(lambda: F.linear(x, weight))
        matmul.allow_bf16_reduced_precision_reduction = not matmul.allow_bf16_reduced_precision_reduction
        row["reduced_precision_flipped_us"] = 1e3 * graph_ms(lambda: F.linear(x, weight))
        matmul.allow_bf16_reduced_precision_reduction = not matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_us"] = 1e3 * graph_ms(lambda: F.linear(x, weight))
        torch.backends.cuda.preferred_blas_library("cublas")
        for padded in (80, 96, 128):
            x_padded = torch.randn(padded, k, device="cuda", dtype=torch.bfloat16)
            row[f"cublas_{padded}_rows_us"] = 1e3 * graph_ms(lambda: F.linear(x_padded, weight))
        if name.startswith("tp2"):
            ref = F.linear(x.float(), weight.float())
            ones_m, ones_n = torch.ones(rows, device="cuda"), torch.ones(n, device="cuda")
            best: tuple[float, list] | None = None
            for config in triton_configs(rows):
                try:
                    err = rel_err(fp8_gemm(x, ones_m, weight, ones_n, config=config), ref)
                except OutOfResources:
                    continue
                if not err < 1e-2:
                    log(f"MISS {name} {tuple(config)}: rel err {err:.2e}")
                    continue
                us = 1e3 * graph_ms(lambda: fp8_gemm(x, ones_m, weight, ones_n, config=config))
                if best is None or us < best[0]:
                    best = (us, list(config))
            if best is not None:
                row["triton_best_us"], row["triton_best_config"] = best
        moved = 2 * (n * k + rows * k + rows * n)
        for key in [key for key in row if key.endswith("_us")]:
            row[key.removesuffix("_us") + "_pct_bw"] = round(100 * moved / (row[key] * 1e-6) / bandwidth, 1)
        report.append(row)
        log(json.dumps(row))
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "results": report}, f, indent=1)


if __name__ == "__main__":
    main()
