"""The few-row GEMV in each weight format at Llama-3-8B's projections (part of benchmarks.device.quant).

`gemv_kernels`: per projection and format at one row, the GEMV with the prologue the model fuses there (its
default config, then FP8's small sweep), 2-8 rows with --multi-rows, beside the path each replaces (cuBLAS,
per-token FP8 + _scaled_mm, dequant_matmul), each checked against gemv_ref first. `int4_sweep`: the int4 GEMV
by coordinate descent over its config axes. Each prints the TUNED_* literal for tgi_compat/kernels/gemv.py.
"""

# ruff: noqa: B023  (each lambda is timed inside the loop iteration that defines it)

from __future__ import annotations

import dataclasses
import time

import torch
import triton

from benchmarks.device.gemv_cases import (
    GROUP,
    MAX_ROWS,
    PROLOGUE_NAMES,
    PROLOGUES,
    GemvCase,
    rel_err,
    weight_bytes,
    weight_copies,
)
from benchmarks.device.timing import log, pct_of, replay_us
from benchmarks.shapes import LLAMA3_8B, projections
from tgi_compat.kernels.gemv.config import int4_config, int4_register_estimate
from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.int4 import int4_launch_tiles
from tgi_compat.kernels.gemv.int4_one_row import one_row_tiles
from tgi_compat.kernels.gemv.types import PROLOGUE_NONE, GemvConfig, QuantizedWeight
from tgi_compat.kernels.quant.dequant_matmul import dequant_matmul
from tgi_compat.kernels.quant.per_token import quant_per_token

# Llama-3-8B's decode projections: (N, K, the prologue the model fuses into each)
SHAPES = {name: (*projections(LLAMA3_8B)[name], prologue) for name, prologue in PROLOGUES.items()}
FORMATS = ("bf16", "fp8", "int8", "int4")
MULTI_ROWS = [2, 4, MAX_ROWS]
PROLOGUE_CONSTANTS = {0: "PROLOGUE_NONE", 1: "PROLOGUE_RMSNORM", 2: "PROLOGUE_SILU_MUL"}  # for the literals
# FP8 / int8 GEMV configs swept at one row (GemvConfig's fields in order: block_n, block_k, num_warps, num_stages,
# prefetch, split_k, separate_prologue); bf16 runs its tuned configs (benchmarks.device.tune_gemv sweeps those).
# At most 64 fp32 accumulators a thread (block_n x block_k / threads), with and without prefetch.
ROW_SCALED_TILES = [(8, 1024, 4, 1), (16, 512, 4, 1), (8, 2048, 8, 1), (16, 1024, 8, 1)]
ROW_SCALED_TILES += [(32, 512, 8, 1), (4, 2048, 4, 1)]
SWEEP_ROW_SCALED = ROW_SCALED_TILES + [(4, 4096, 8, 1)] + [(*tile, True) for tile in ROW_SCALED_TILES]
SWEEP_ROW_SCALED.append((16, 512, 4, 1, False, 1, True))  # separate_prologue
# The int4 GEMV is tuned by coordinate descent from its rule-of-thumb config (tgi_compat.kernels.gemv.config.int4_config):
# one axis at a time over these values, keeping the best, two rounds at one row and one at 2-8 rows, skipping
# configs that would spill on sm_90 (int4_register_estimate), within a time budget (compiles dominate).
INT4_AXES = {
    "block_k": (256, 512, 1024, 2048, 4096),
    "num_warps": (1, 2, 4, 8),
    "block_n": (2, 4, 8, 16),
    "split_k": (1, 2, 4),
    "num_stages": (1, 3),
    "prefetch": (False, True),
    "separate_prologue": (False, True),
    "one_row": (False, True),  # one row only: tgi_compat/kernels/gemv_int4_one_row.py instead of the tile kernel
}
INT4_ROW_AXES = ("block_k", "num_warps", "block_n", "split_k", "separate_prologue")  # at 2-8 rows
# Starting points measured beside the default at one row: (block_n, block_k, num_warps, split_k) of the tile
# kernel, K tiles of 1,024 features a warp (x's layout is then the weight tile's; one axis at a time cannot reach
# one such point from another); (block_n, block_k, split_k) of the one-row kernel.
INT4_SEEDS = [(n, 4096, 4, 1) for n in (4, 8, 2)] + [(8, 2048, 2, 1), (4, 2048, 2, 1), (8, 1024, 1, 1)]
INT4_SEEDS += [(8, 2048, 2, 2), (4, 1024, 1, 2), (8, 2048, 4, 1)]
INT4_ONE_ROW_SEEDS = [(16, 4096, 1), (16, 2048, 7), (8, 4096, 1)]


def config_literal(config: GemvConfig) -> str:
    """`config` as the shortest GemvConfig(...) call (fields at their defaults left out)."""
    default = GemvConfig()
    fields = [
        f"{f.name}={value!r}"
        for f in dataclasses.fields(config)
        if (value := getattr(config, f.name)) != getattr(default, f.name)
    ]
    return f"GemvConfig({', '.join(fields)})"


def gemv_kernels(bandwidth: float, sweep: bool, multi_rows: bool) -> dict:
    """Every shape and format: checks, the GEMV as the model runs it and the FP8 sweep's best, the replaced path."""
    report = {"rows": [], "checks": [fp8_subnormals_check()], "best_configs": {}, "tuned_row_scaled": {}}
    for shape, (n, k, prologue) in SHAPES.items():
        case = GemvCase(k)
        for fmt in FORMATS:
            bench_format(report, case, shape, n, prologue, fmt, bandwidth, sweep, multi_rows)
            torch.cuda.empty_cache()
    if report["best_configs"]:
        log("TUNED_ROW_SCALED = {  # tgi_compat/kernels/gemv.py")
        for (n, k, prologue), config in report["tuned_row_scaled"].items():
            log(f"    ({n}, {k}, {PROLOGUE_CONSTANTS[prologue]}): {config_literal(config)},")
        log("}")
    return report


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
    weights = weight_copies(fmt, n, k)
    w0, moved = weights[0], weight_bytes(weights[0])

    def us(fn) -> float:
        return replay_us([lambda w=w: fn(w) for w in weights])

    def record(kernel: str, t_us: float) -> None:
        pct = pct_of(bandwidth, moved, t_us * 1e-3)
        report["rows"].append(dict(shape=shape, n=n, k=k, fmt=fmt, kernel=kernel, us=t_us, pct_bw=pct))
        log(f"  {shape:8s} {fmt:5s} {kernel:40s} {t_us:8.1f} us  {pct:5.1f}% of copy bandwidth")

    for num_rows in (1,) if fmt == "bf16" else (1, MAX_ROWS):  # plain weights: one row only
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
    for num_rows in (1, MAX_ROWS):  # the path the GEMV replaces, at one row and at the row limit
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


class Int4Sweep:
    """Timings of int4 GEMV configs per (rows, shape), each config once, within a deadline."""

    def __init__(self, bandwidth: float, budget_s: float):
        self.bandwidth, self.deadline = bandwidth, time.monotonic() + budget_s
        self.cases = {shape: GemvCase(k) for shape, (_, k, _) in SHAPES.items()}
        self.weights = {shape: weight_copies("int4", n, k) for shape, (n, k, _) in SHAPES.items()}
        self.timed: dict[tuple[int, str], dict[GemvConfig, float]] = {}  # (rows, shape) -> config -> us
        self.timings: list[dict] = []

    def launched(self, rows: int, shape: str, config: GemvConfig) -> GemvConfig:
        """The config as the GEMV launches it (its own tile and split rules): one key per kernel it runs."""
        _, k, prologue = SHAPES[shape]
        separate = config.separate_prologue and prologue != PROLOGUE_NONE
        if config.one_row and rows == 1:
            periods, _, split_k = one_row_tiles(k, GROUP, config)
            return dataclasses.replace(config, block_k=periods * GROUP, split_k=split_k, separate_prologue=separate)
        block_k, split_k = int4_launch_tiles(k, GROUP, config)
        return dataclasses.replace(config, block_k=block_k, split_k=split_k, separate_prologue=separate, one_row=False)

    def measure(self, rows: int, shape: str, config: GemvConfig) -> None:
        config = self.launched(rows, shape, config)
        seen = self.timed.setdefault((rows, shape), {})
        spills = not config.one_row and int4_register_estimate(config, rows) > 200
        if config in seen or spills or time.monotonic() > self.deadline:
            return
        case, prologue = self.cases[shape], SHAPES[shape][2]
        try:
            t_us = replay_us([lambda w=w: case.run(w, prologue, rows, config) for w in self.weights[shape]])
        except Exception as exc:  # a config Triton cannot build (registers, shared memory)
            log(f"    int4 {shape} {rows} row(s) {config_literal(config)} failed: {type(exc).__name__}")
            t_us = float("inf")
        seen[config] = t_us
        pct = pct_of(self.bandwidth, weight_bytes(self.weights[shape][0]), t_us * 1e-3)
        self.timings.append(dict(shape=shape, rows=rows, config=dataclasses.asdict(config), us=t_us, pct_bw=pct))
        log(f"    int4 {shape:8s} {rows} row(s) {config_literal(config):72s} {t_us:8.1f} us {pct:5.1f}% of copy BW")

    def seeds(self, rows: int, shape: str) -> None:
        """The default config, and at one row the seeds that divide K."""
        _, k, _ = SHAPES[shape]
        for block_n, block_k, num_warps, split_k in INT4_SEEDS if rows == 1 else []:
            if k % (block_k * split_k) == 0:
                self.measure(rows, shape, GemvConfig(block_n, block_k, num_warps, num_stages=1, split_k=split_k))
        for block_n, block_k, split_k in INT4_ONE_ROW_SEEDS if rows == 1 else []:
            if k % (block_k * split_k) == 0:
                one_row = GemvConfig(block_n, block_k, block_k // 1024, num_stages=1, split_k=split_k, one_row=True)
                self.measure(rows, shape, one_row)


def int4_sweep(bandwidth: float, budget_s: float) -> dict:
    """Coordinate descent (INT4_AXES) from the rule-of-thumb config, per projection and row count, within
    `budget_s`: a round at one row, then at 8, 2 and 4 rows, then a second round at one row. Prints each
    config's time, the default against the best, and the TUNED_INT4 literal."""
    sweep = Int4Sweep(bandwidth, budget_s)
    defaults: dict[tuple[int, str], GemvConfig] = {}
    for rows, axes in ((1, INT4_AXES), (8, INT4_ROW_AXES), (2, INT4_ROW_AXES), (4, INT4_ROW_AXES), (1, INT4_AXES)):
        for shape, (n, k, prologue) in SHAPES.items():
            if (rows, shape) not in defaults:
                defaults[(rows, shape)] = sweep.launched(rows, shape, int4_config(k, rows, GROUP, n, prologue))
                sweep.measure(rows, shape, defaults[(rows, shape)])
                sweep.seeds(rows, shape)
            seen = sweep.timed.get((rows, shape))
            for axis in axes if seen else ():  # none: out of budget
                best = min(seen, key=seen.get)
                for value in INT4_AXES[axis]:
                    sweep.measure(rows, shape, dataclasses.replace(best, **{axis: value}))
    report: dict = {"timings": sweep.timings, "cases": [], "tuned": {}}
    for (rows, shape), seen in sorted((key, seen) for key, seen in sweep.timed.items() if seen):
        n, k, prologue = SHAPES[shape]
        moved = weight_bytes(sweep.weights[shape][0])
        default = defaults[(rows, shape)] if defaults[(rows, shape)] in seen else next(iter(seen))
        best = min(seen, key=seen.get)
        pct = {c: pct_of(bandwidth, moved, seen[c] * 1e-3) for c in (default, best)}
        case = dict(shape=shape, n=n, k=k, rows=rows, configs_timed=len(seen), default=dataclasses.asdict(default))
        case |= dict(default_us=seen[default], default_pct_bw=pct[default], best=dataclasses.asdict(best))
        report["cases"].append(case | dict(best_us=seen[best], best_pct_bw=pct[best]))
        report["tuned"][(n, k, prologue, triton.next_power_of_2(rows))] = best
        log(
            f"int4 {shape:8s} {rows} row(s): default {seen[default]:7.1f} us ({pct[default]:3.0f}% of copy BW), "
            f"best of {len(seen):2d} {seen[best]:7.1f} us ({pct[best]:3.0f}%) {config_literal(best)}"
        )
    log("TUNED_INT4 = {  # tgi_compat/kernels/gemv.py")
    for (n, k, prologue, block_m), config in report["tuned"].items():
        log(f"    ({n}, {k}, {PROLOGUE_CONSTANTS[prologue]}, {block_m}): {config_literal(config)},")
    log("}")
    return report
