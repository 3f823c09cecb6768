"""Tune the fused-experts kernels on the GPU (not CI): block sizes per token count, in a few minutes.

    python3 -m benchmarks.device.tune_fused_moe [--shape mixtral-8x7b] [--budget-s 200]

For each token count (1, 2, 4, ... 512; the decode sizes first) with realistic routing (top-k of a
softmax over random logits): every candidate tiling of the up launch (gate|up + SiLU-mul) and of the
down launch (routed), for each BLOCK_M (16/32/64) and for the GEMV path where it applies, each launch
timed alone as a CUDA-graph replay (weights >> L2, so every replay reads them from HBM). The best
BLOCK_M is then chosen on the whole block (alignment, up, down, top-k sum) in a graph. Prints the table
and writes it as tgi_compat/kernels/moe/tuned.py's text to $OUT/fused_moe_tuned.py (or --write FILE): copy
that file over tgi_compat/kernels/moe/tuned.py to keep it.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.device.timing import graph_ms, log, out_path
from benchmarks.shapes import EXPERTS
from tgi_compat.kernels.moe.align import align_by_expert
from tgi_compat.kernels.moe.configs import LaunchConfig, MoeConfig
from tgi_compat.kernels.moe.expert_gemv import moe_gemv_down, moe_gemv_up
from tgi_compat.kernels.moe.fused_moe import default_moe_config, fused_moe
from tgi_compat.kernels.moe.grouped_gemm import grouped_gemm
from tgi_compat.kernels.moe.tuned import TUNED

TOKEN_COUNTS = (1, 64, 16, 4, 2, 8, 32, 128, 256, 512)  # most important first: a budget cut drops the tail
# (block_n, block_k, num_warps, num_stages, group_m)
GROUPED = [(32, 64, 4, 5, 1), (32, 128, 4, 4, 1), (32, 256, 4, 3, 1), (64, 64, 4, 4, 1), (64, 128, 4, 4, 1)]
GROUPED += [(64, 128, 4, 3, 8), (64, 256, 4, 3, 1), (64, 128, 8, 4, 1), (128, 64, 4, 4, 1), (128, 128, 4, 3, 1)]
GROUPED += [(128, 128, 8, 3, 8), (128, 64, 8, 4, 16)]
# GEMV: a [BLOCK_N, BLOCK_K] fp32 accumulator per launch (two in the up kernel) held in registers
GEMV_UP = [(2, 512, 4, 2), (4, 256, 4, 3), (4, 512, 4, 1), (4, 512, 8, 2), (8, 256, 4, 2), (8, 512, 8, 1)]
GEMV_DOWN = [(2, 1024, 4, 1), (4, 512, 4, 1), (4, 1024, 4, 1), (8, 256, 4, 2), (8, 512, 4, 1), (16, 256, 8, 2)]
GEMV_MAX_PAIRS = 16


def graph_us(fn) -> float:
    """Microseconds per call, from a graph of 10 calls: weights >> L2, so every replay reads them from HBM."""
    return 1e3 * graph_ms(fn, calls=10, warmup=5, rep=25)


class Problem:
    """One token count's inputs on the GPU, shared by every candidate."""

    def __init__(self, weights: tuple[torch.Tensor, torch.Tensor], num_tokens: int, top_k: int):
        self.w13, self.w2 = weights
        experts, two_inter, hidden = self.w13.shape
        self.top_k, self.num_tokens, self.experts = top_k, num_tokens, experts
        self.x = torch.randn(num_tokens, hidden, device="cuda", dtype=self.w13.dtype)
        logits = torch.randn(num_tokens, experts, device="cuda")
        self.topk_weights, self.topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
        pairs = num_tokens * top_k
        self.inter = torch.randn(pairs, two_inter // 2, device="cuda", dtype=self.w13.dtype)
        self.pair_weights = self.topk_weights.flatten().contiguous()
        self.up_out = torch.empty(pairs, two_inter // 2, device="cuda", dtype=self.w13.dtype)
        self.down_out = torch.empty(pairs, hidden, device="cuda", dtype=self.w13.dtype)

    def time_grouped(self, block_m: int, up: bool, config: LaunchConfig) -> float:
        alignment = align_by_expert(self.topk_ids, self.experts, block_m)
        if up:
            args = (self.x, self.w13, self.up_out, alignment, None, self.top_k, True, True, config)
        else:
            args = (self.inter, self.w2, self.down_out, alignment, self.pair_weights, self.top_k, False, False, config)
        return graph_us(lambda: grouped_gemm(*args))

    def time_gemv(self, up: bool, config: LaunchConfig) -> float:
        if up:
            return graph_us(lambda: moe_gemv_up(self.x, self.w13, self.topk_ids, config))
        return graph_us(lambda: moe_gemv_down(self.inter, self.w2, self.topk_weights, self.topk_ids, config))

    def time_block(self, config: MoeConfig) -> float:
        return graph_us(lambda: fused_moe(self.x, self.w13, self.w2, self.topk_weights, self.topk_ids, config))


def best_launch(time_one, candidates: list[LaunchConfig]) -> tuple[LaunchConfig, float]:
    results = []
    for config in candidates:
        try:
            results.append((time_one(config), config))
        except Exception as exc:  # out of shared memory / registers: not a candidate on this GPU
            log(f"    skip {config}: {type(exc).__name__}")
    us, config = min(results, key=lambda r: r[0])
    return config, us


def tune_tokens(problem: Problem) -> tuple[MoeConfig, float, dict]:
    grouped = [LaunchConfig(n, k, w, s, g) for n, k, w, s, g in GROUPED]
    options: dict[str, tuple[MoeConfig, float]] = {}
    block_ms = [16, 32, 64] if problem.num_tokens * problem.top_k > problem.experts else [16, 32]
    for block_m in block_ms:
        up, up_us = best_launch(lambda c, m=block_m: problem.time_grouped(m, True, c), grouped)
        down, down_us = best_launch(lambda c, m=block_m: problem.time_grouped(m, False, c), grouped)
        config = MoeConfig(block_m, up, down)
        options[f"m{block_m}"] = (config, problem.time_block(config))
        log(f"  block_m {block_m}: up {up_us:.1f} us {up}, down {down_us:.1f} us {down}")
    if problem.num_tokens * problem.top_k <= GEMV_MAX_PAIRS:
        up, up_us = best_launch(lambda c: problem.time_gemv(True, c), [LaunchConfig(*c) for c in GEMV_UP])
        down, down_us = best_launch(lambda c: problem.time_gemv(False, c), [LaunchConfig(*c) for c in GEMV_DOWN])
        config = MoeConfig(0, up, down)
        options["gemv"] = (config, problem.time_block(config))
        log(f"  gemv: up {up_us:.1f} us {up}, down {down_us:.1f} us {down}")
    default = default_moe_config(problem.num_tokens, problem.experts, problem.top_k)
    default_us = problem.time_block(default)
    name, (config, us) = min(options.items(), key=lambda item: item[1][1])
    summary = {key: round(value[1], 1) for key, value in options.items()} | {"default": round(default_us, 1)}
    return config, us, summary


def expert_bytes_read(problem: Problem) -> int:
    """Bytes of expert weights the block must read: each chosen expert's w13 and w2 once."""
    chosen = problem.topk_ids.unique().numel()
    return chosen * (problem.w13[0].numel() + problem.w2[0].numel()) * problem.w13.element_size()


def render_table(shape: tuple[int, int, int, int], tuned: dict[int, MoeConfig], device: str) -> str:
    """tgi_compat/kernels/moe/tuned.py's text: this shape's new entries and the other shapes' old ones."""
    experts, inter, hidden, _ = shape
    table = {key: config for key, config in TUNED.items() if key[:3] != (experts, inter, hidden)}
    table |= {(experts, inter, hidden, tokens): config for tokens, config in tuned.items()}
    lines = [
        '"""Fused-MoE block sizes measured by benchmarks/device/tune_fused_moe.py; generated, do not edit by hand."""',
        "",
        "from tgi_compat.kernels.moe.configs import LaunchConfig, MoeConfig",
        "",
        f"# {device}, bf16 ({experts}, {inter}, {hidden}). Key: (experts, intermediate size, hidden size, token bucket).",
        "TUNED: dict[tuple[int, int, int, int], MoeConfig] = {",
    ]
    for key, config in sorted(table.items()):
        lines += [
            f"    {key}: MoeConfig(",
            f"        {config.block_m},",
            f"        {config.up!r},",
            f"        {config.down!r},",
            "    ),",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def tune(shape_name: str, budget_s: float, token_counts=TOKEN_COUNTS) -> tuple[dict[int, MoeConfig], dict]:
    """{token bucket: best config} for one shape, within about budget_s, and the measurements."""
    experts, inter, hidden, top_k = EXPERTS[shape_name]
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    start = time.perf_counter()
    tuned, report = {}, {}
    for tokens in token_counts:
        if time.perf_counter() - start > budget_s:
            log(f"tune budget of {budget_s:.0f} s spent: {tokens} tokens and after keep the default rule")
            break
        problem = Problem((w13, w2), tokens, top_k)
        log(f"{shape_name}, {tokens} tokens:")
        config, us, summary = tune_tokens(problem)
        gb_s = expert_bytes_read(problem) / (us * 1e-6) / 1e9
        tuned[tokens] = config
        report[tokens] = dict(best_us=us, expert_gb_s=gb_s, block_us=summary, config=repr(config))
        log(f"  best {us:.1f} us ({gb_s:.0f} GB/s of expert weights; default rule {summary['default']} us): {config}")
    del w13, w2
    torch.cuda.empty_cache()
    log(f"tuned {shape_name} in {time.perf_counter() - start:.0f} s")
    return tuned, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b", choices=list(EXPERTS))
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new token counts after this")
    parser.add_argument("--write", help="where to write the table module (default $OUT/fused_moe_tuned.py)")
    args = parser.parse_args()
    tuned, _ = tune(args.shape, args.budget_s)
    text = render_table(EXPERTS[args.shape], tuned, torch.cuda.get_device_name())
    print(text)
    target = args.write or out_path("fused_moe_tuned.py")
    with open(target, "w") as f:
        f.write(text)
    log(f"wrote {target}: copy it over tgi_compat/kernels/moe/tuned.py")


if __name__ == "__main__":
    main()
