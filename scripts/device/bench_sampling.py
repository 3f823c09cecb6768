"""GPU benchmark of the all-greedy choice (not CI): tgi_compat/kernels/sampling/greedy_pick.py against the torch computation it
replaced (argmax + gather + logsumexp + the float64 packing for the host copy), Llama-3's 128,256 ids.

    PYTHONPATH=$PWD python3 scripts/device/bench_sampling.py [--json $OUT/bench_sampling.json]

Each is timed as launched by the sampler (eager: its launches are part of the cost) and replayed from a CUDA
graph (the GPU time alone); float32 logits, as the LM head hands them to the sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_gpu import graph_ms, log, median_ms

from tgi_compat.kernels.sampling.greedy_pick import greedy_pick, greedy_pick_ref

VOCAB = 128256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_sampling.json"))
    args = parser.parse_args()
    rows_out = []
    for rows in (1, 8, 64, 256):
        logits = torch.randn(rows, VOCAB, device="cuda") * 4
        row = {"rows": rows}
        for name, fn in (("torch", greedy_pick_ref), ("kernel", greedy_pick)):
            row[f"{name}_eager_us"] = 1e3 * median_ms(lambda fn=fn, x=logits: fn(x))
            row[f"{name}_graph_us"] = 1e3 * graph_ms(lambda fn=fn, x=logits: fn(x))
        rows_out.append(row)
        log(f"{rows:4d} rows: torch {row['torch_eager_us']:6.1f} us eager / {row['torch_graph_us']:6.1f} us graph, "
            f"kernel {row['kernel_eager_us']:6.1f} / {row['kernel_graph_us']:6.1f} us")  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
