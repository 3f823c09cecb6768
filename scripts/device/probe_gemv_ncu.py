"""One few-row GEMV per weight format, launched a few times, for Nsight Compute to read (not CI):

    ncu --clock-control none -k regex:gemv --launch-skip 3 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python3 scripts/device/probe_gemv_ncu.py --formats int4,bf16 --shape gate_up

Each format runs tgi_compat.kernels.gemv.gemv at its default config (the one the model runs), on a Llama-3-8B projection shape,
with the same random weights bench_quant.py makes; --one-row (int4 only) runs the one-row kernel
(tgi_compat/kernels/gemv/int4_one_row.py) instead, with --block-n rows a program, --block-k features a tile (a warp per 1,024)
and --split-k. Without ncu it prints each launch's time (CUDA events), so a
run under ncu can be told apart from one without.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_quant import make_weight

from tgi_compat.kernels.gemv.config import gemv_config_for
from tgi_compat.kernels.gemv.gemv import gemv
from tgi_compat.kernels.gemv.types import PROLOGUE_NONE, GemvConfig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default="int4,bf16")
    parser.add_argument("--shape", choices=SHAPES, default="gate_up")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--launches", type=int, default=6)
    parser.add_argument("--one-row", action="store_true")
    parser.add_argument("--block-n", type=int, default=16)
    parser.add_argument("--block-k", type=int, default=4096)
    parser.add_argument("--split-k", type=int, default=1)
    args = parser.parse_args()
    n, k = SHAPES[args.shape]
    for fmt in args.formats.split(","):
        weight = make_weight(fmt, n, k)
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        config = gemv_config_for(x, weight, PROLOGUE_NONE)
        if args.one_row and fmt == "int4":
            config = GemvConfig(block_n=args.block_n, block_k=args.block_k, num_warps=max(1, args.block_k // 1024),
                                num_stages=1, split_k=args.split_k, one_row=True)  # fmt: skip
        for _ in range(args.launches):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gemv(x, weight, config=config)
            end.record()
            torch.cuda.synchronize()
            print(f"{fmt} {args.shape} {args.rows} row(s) {config}: {1e3 * start.elapsed_time(end):.1f} us", flush=True)


if __name__ == "__main__":
    main()
