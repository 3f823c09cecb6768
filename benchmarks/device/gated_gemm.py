"""The gated MLP GEMM (tgi_compat/kernels/gemm/gated.py) against cuBLAS's [gate | up] GEMM + silu_mul, < 2 min on an H100:

    python3 -m benchmarks.device.gated_gemm [--json $OUT/bench_gated_gemm.json]

Qwen2.5-VL-7B's vision MLP (K 1280, inner 3456 padded, bias) over 1 and 3 images of 1024px (5,476 patches each),
and Llama-3-8B's gate|up at a 4,096-token prefill chunk (K 4096, inner 14336, no bias). For each shape: cuBLAS + the
silu_mul pass as the encoder runs them today, and every config of a small sweep of the fused kernel, each checked
against the float32 reference first (a miss is reported, not timed). Times are do_bench medians of CUDA-graph
replays (L2 flushed); TFLOP/s counts the [gate | up] product's 2 * M * 2P * K.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
from triton.runtime.errors import OutOfResources

from benchmarks.device.gemv_cases import rel_err
from benchmarks.device.timing import copy_bandwidth, device_info, graph_ms, log, out_path, write_json
from tgi_compat.kernels.elementwise.silu_mul import silu_mul
from tgi_compat.kernels.gemm.gated import DEFAULT_CONFIG, GatedGemmConfig, gated_gemm, gated_gemm_ref

# (name, rows, K, P, bias)
SHAPES = [
    ("qwen2.5-vl vision, 1 image", 5476, 1280, 3456, True),
    ("qwen2.5-vl vision, 3 images", 16428, 1280, 3456, True),
    ("llama-3-8b gate|up, 4096 tokens", 4096, 4096, 14336, False),
]
# (block_m, block_n, block_k, warps, stages, group_m, tma): two [BLOCK_M, BLOCK_N] fp32 accumulators a program, so
# 128 x 128 holds as many as one 128 x 256 tile of a plain GEMM
SWEEP = [
    GatedGemmConfig(128, 128, 64, 8, 3),
    GatedGemmConfig(128, 128, 64, 8, 4),
    GatedGemmConfig(128, 128, 32, 8, 5),
    GatedGemmConfig(128, 128, 64, 8, 3, tma=False),
    GatedGemmConfig(128, 64, 64, 4, 4),
    GatedGemmConfig(128, 64, 64, 8, 4),
    GatedGemmConfig(128, 64, 128, 8, 3),
    GatedGemmConfig(64, 128, 64, 4, 4),
    GatedGemmConfig(256, 64, 64, 8, 3),
    GatedGemmConfig(128, 128, 64, 8, 3, group_m=16),
    GatedGemmConfig(128, 128, 64, 8, 3, group_m=4),
]


def unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return silu_mul(torch.nn.functional.linear(x, weight, bias))


def run_shape(name: str, rows: int, hidden: int, padded: int, has_bias: bool) -> dict:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(2 * padded, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    bias = (torch.randn(2 * padded, device="cuda") / 10).to(torch.bfloat16) if has_bias else None
    flops = 2 * rows * 2 * padded * hidden
    ref = gated_gemm_ref(x, weight, bias)
    base_ms = graph_ms(functools.partial(unfused, x, weight, bias))
    gemm_ms = graph_ms(functools.partial(torch.nn.functional.linear, x, weight, bias))
    log(f"{name}: cuBLAS + silu_mul {base_ms:.3f} ms (GEMM alone {gemm_ms:.3f}, {flops / gemm_ms / 1e9:.0f} TFLOP/s)")
    result: dict = dict(
        shape=name, rows=rows, k=hidden, padded=padded, cublas_silu_mul_ms=base_ms, cublas_gemm_ms=gemm_ms
    )
    configs: list[dict[str, Any]] = []
    for config in SWEEP:
        try:
            err = rel_err(gated_gemm(x, weight, bias, config=config), ref)
        except OutOfResources as exc:
            log(f"  {config}: {exc}")
            continue
        if not err < 1e-2:
            log(f"  {config}: rel err {err:.2e}, not timed")
            continue
        ms = graph_ms(functools.partial(gated_gemm, x, weight, bias, config=config))
        configs.append(dict(config=config._asdict(), ms=ms, tflops=flops / ms / 1e9, err=err))
        log(f"  {tuple(config)}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {base_ms / ms:.2f}x")
    best = min(configs, key=lambda c: c["ms"]) if configs else None
    if best is not None:
        log(f"  best {best['config']}: {best['ms']:.3f} ms against {base_ms:.3f} ({base_ms / best['ms']:.2f}x)")
    return dict(result, configs=configs, best=best, default=DEFAULT_CONFIG._asdict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=out_path("bench_gated_gemm.json"))
    args = parser.parse_args()
    report = dict(device=device_info(copy_bandwidth()), shapes=[run_shape(*shape) for shape in SHAPES])
    write_json(args.json, report)


if __name__ == "__main__":
    main()
