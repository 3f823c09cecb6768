"""The symmetric-memory all-reduce against NCCL on a multi-GPU host: same sums, and time per call.

    python scripts/device/check_symmetric_all_reduce.py     # 2 GPUs; writes $OUT/symmetric_all_reduce.json

For each size (bf16 elements of one decode step's hidden states), every rank sums a rank-dependent
tensor both ways and the results must agree exactly; then 64 all-reduces (one batch-1 decode step of
Llama-3-8B at --num-shard 2) are captured in a CUDA graph each way and replayed to time them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.multiprocessing as mp

SIZES = [4096, 8 * 4096, 64 * 4096, 128 * 4096]  # 8 KiB .. 1 MiB of bf16
CALLS_PER_GRAPH = 64


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def graph_time_us(fn, x: torch.Tensor) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn(x)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 50
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps / CALLS_PER_GRAPH


def worker(rank: int, size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from modeling.parallel import init_tensor_parallel

    tp = init_tensor_parallel(rank, size, "127.0.0.1", port, torch.device("cuda", rank))
    assert tp.symmetric is not None, "symmetric-memory all-reduce did not start"
    rows = []
    for numel in SIZES:
        base = torch.randn(numel, device=tp.device, generator=torch.Generator(tp.device).manual_seed(rank))
        x = base.bfloat16()
        by_nccl, by_symm = x.clone(), x.clone()
        dist.all_reduce(by_nccl)
        fits = tp.symmetric.fits(by_symm)
        tp.all_reduce(by_symm)
        torch.cuda.synchronize()
        max_diff = (by_nccl.float() - by_symm.float()).abs().max().item()
        nccl_us = graph_time_us(dist.all_reduce, x.clone())
        symm_us = graph_time_us(tp.symmetric.all_reduce_, x.clone()) if fits else float("nan")
        rows.append({"bytes": numel * 2, "symmetric_used": fits, "max_abs_diff": max_diff,
                     "nccl_us": nccl_us, "symmetric_us": symm_us})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
        for row in rows:
            print(row, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    size = min(2, torch.cuda.device_count())
    assert size == 2, "needs 2 GPUs"
    out = os.path.join(os.environ.get("OUT", "."), "symmetric_all_reduce.json")
    mp.spawn(worker, args=(size, free_port(), out), nprocs=size)


if __name__ == "__main__":
    main()
