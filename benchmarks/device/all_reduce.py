"""The symmetric-memory all-reduce kernels against NCCL on a multi-GPU host: same sums, and time per call.

    python3 -m benchmarks.device.all_reduce     # every GPU; writes $OUT/symmetric_all_reduce.json

For each size (bf16 elements of one decode step's hidden states), every rank sums a rank-dependent
tensor with NCCL and with each kernel of tgi_compat.modeling.parallel.symmetric_all_reduce (triton, torch), and the
results must agree exactly; then 64 all-reduces (one batch-1 decode step of Llama-3-8B at --num-shard 2)
are captured in a CUDA graph each way and replayed to time them. At more than 2 ranks NCCL may add in another
order than the kernels, so there a difference of one bf16 unit need not be an error. A stress part then makes
300 sums of random sizes back to back with each kernel, eagerly and replayed from a CUDA graph, each against the
Triton kernel's own definition (fp32, in rank order, from the gathered inputs), which must hold bit for bit.
Last, the vocab-parallel logits' gather (`TensorParallel.all_gather_columns`, Llama-3's vocabulary over the
ranks): the Triton kernel's against NCCL's, equal and timed the same way; and the sum fused with the residual
add and RMSNorm (`SymmetricAllReduce.all_reduce_rms_norm`) against the sum then `tgi_compat.kernels.elementwise.rmsnorm.rmsnorm`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.device.timing import out_path, replay_us
from benchmarks.server_process import free_port
from benchmarks.shapes import LLAMA3_8B

HIDDEN, VOCAB = LLAMA3_8B["hidden_size"], LLAMA3_8B["vocab_size"]  # the logits each rank gathers: [rows, VOCAB / ranks]
# rows of Llama-3-8B's hidden state: 8 KiB .. 8 MiB of bf16 (the sizes past the kernel's max_bytes are skipped)
SIZES = [rows * HIDDEN for rows in (1, 8, 64, 128, 256, 512, 1024)]
CALLS_PER_GRAPH = 64  # one batch-1 decode step of Llama-3-8B at --num-shard 2
GATHER_ROWS = [1, 4, 64]
NORM_ROWS = [1, 64, 256]


def graph_time_us(fn, x: torch.Tensor) -> float:
    return replay_us([lambda: fn(x)] * CALLS_PER_GRAPH, reps=50, warm_replays=5)


def stress_mismatches(kernel, device: torch.device, rank: int, count: int = 300) -> list[int]:
    """Sums of random sizes (the same on every rank) back to back, eagerly and from one CUDA graph, each
    against the fp32 rank-order sum of the gathered inputs: how many differ, eager and graph."""
    import torch.distributed as dist

    from tgi_compat.kernels.comm.one_shot_all_reduce import all_reduce_ref

    # even sizes: torch's kernel takes whole 4-byte words (a model's sums are rows of the hidden size)
    sizes = (2 * torch.randint(1, kernel.max_bytes // 4, (count,), generator=torch.Generator().manual_seed(0))).tolist()
    generator = torch.Generator(device).manual_seed(100 + rank)
    inputs = [torch.randn(n, device=device, generator=generator).bfloat16() for n in sizes]
    expected = []
    for x in inputs:
        gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, x)
        expected.append(all_reduce_ref(gathered))
    eager = [x.clone() for x in inputs]
    for x in eager:
        kernel.all_reduce_(x)
    graphed = [x.clone() for x in inputs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in graphed:
            kernel.all_reduce_(x)
    for x, source in zip(graphed, inputs):
        x.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    return [sum(not torch.equal(a, b) for a, b in zip(results, expected)) for results in (eager, graphed)]


def gather_rows(tp, triton_kernel, size: int) -> list[dict]:
    """The logits' gather through NCCL and through the Triton kernel: equal, and us a call."""
    by_nccl, by_triton = dataclasses.replace(tp, symmetric=None), dataclasses.replace(tp, symmetric=triton_kernel)
    rows = []
    for num_rows in GATHER_ROWS:
        generator = torch.Generator(tp.device).manual_seed(tp.rank)
        x = torch.randn(num_rows, VOCAB // size, device=tp.device, generator=generator).bfloat16()
        if not triton_kernel.fits(x):
            continue
        expected, got = by_nccl.all_gather_columns(x), by_triton.all_gather_columns(x)
        rows.append(
            {
                "gather_rows": num_rows,
                "bytes_per_rank": x.numel() * 2,
                "equal": torch.equal(expected, got),
                "nccl_us": graph_time_us(by_nccl.all_gather_columns, x),
                "triton_us": graph_time_us(by_triton.all_gather_columns, x),
            }
        )
    return rows


def norm_rows(triton_kernel, device: torch.device, rank: int) -> list[dict]:
    """The sum fused with the residual add and RMSNorm against the sum then `tgi_compat.kernels.elementwise.rmsnorm.rmsnorm` (what a
    layer runs unfused): bit-equal outputs, and us a call of each."""
    from tgi_compat.kernels.elementwise.rmsnorm import rmsnorm

    rows = []
    for num_rows in NORM_ROWS:
        generator = torch.Generator(device).manual_seed(rank)
        x = torch.randn(num_rows, HIDDEN, device=device, generator=generator).bfloat16()
        residual = torch.randn(num_rows, HIDDEN, device=device, generator=torch.Generator(device).manual_seed(99))
        residual = residual.bfloat16()
        weight = (
            1 + torch.randn(HIDDEN, device=device, generator=torch.Generator(device).manual_seed(98)) / 4
        ).bfloat16()
        if 2 * x.numel() > triton_kernel.max_bytes:
            continue

        def unfused(x: torch.Tensor, residual=residual, weight=weight) -> tuple[torch.Tensor, torch.Tensor]:
            total = x.clone()
            triton_kernel.all_reduce_(total)
            summed = torch.empty_like(residual)
            return rmsnorm(total, weight, 1e-5, residual=residual, residual_out=summed), summed

        def fused(x: torch.Tensor, residual=residual, weight=weight) -> tuple[torch.Tensor, torch.Tensor]:
            return triton_kernel.all_reduce_rms_norm(x, residual, weight, 1e-5)

        (normed, summed), (normed_f, summed_f) = unfused(x), fused(x)
        rows.append(
            {
                "norm_rows": num_rows,
                "equal": torch.equal(normed, normed_f) and torch.equal(summed, summed_f),
                "unfused_us": graph_time_us(unfused, x),
                "fused_us": graph_time_us(fused, x),
            }
        )
    return rows


def worker(rank: int, size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from tgi_compat.modeling.parallel import init_tensor_parallel
    from tgi_compat.modeling.parallel.symmetric_all_reduce import KERNELS, SymmetricAllReduce

    tp = init_tensor_parallel(rank, size, "127.0.0.1", port, torch.device("cuda", rank))
    assert tp.symmetric is not None, "symmetric-memory all-reduce did not start"
    kernels = {name: SymmetricAllReduce(tp.device, name) for name in KERNELS}
    rows: list[dict] = []
    for numel in (n for n in SIZES if 2 * n <= kernels["triton"].max_bytes):
        base = torch.randn(numel, device=tp.device, generator=torch.Generator(tp.device).manual_seed(rank))
        x = base.bfloat16()
        by_nccl = x.clone()
        dist.all_reduce(by_nccl)
        row = {"bytes": numel * 2, "nccl_us": graph_time_us(dist.all_reduce, x.clone())}
        for name, kernel in kernels.items():
            by_kernel = x.clone()
            assert kernel.fits(by_kernel)
            try:
                kernel.all_reduce_(by_kernel)
            except (AttributeError, RuntimeError) as exc:  # an op this torch lacks: the same on every rank
                row[f"{name}_error"] = repr(exc)
                continue
            torch.cuda.synchronize()
            row[f"{name}_max_abs_diff"] = (by_nccl.float() - by_kernel.float()).abs().max().item()
            row[f"{name}_us"] = graph_time_us(kernel.all_reduce_, x.clone())
        rows.append(row)
    failed = {name for row in rows for name in kernels if f"{name}_error" in row}
    stress = {
        name: stress_mismatches(kernel, tp.device, rank) for name, kernel in kernels.items() if name not in failed
    }
    gathers = gather_rows(tp, kernels["triton"], size)
    norms = norm_rows(kernels["triton"], tp.device, rank)
    if rank == 0:
        report = {"sizes": rows, "stress_mismatches": stress, "gathers": gathers, "norms": norms}
        Path(out).write_text(json.dumps(report, indent=1))
        for row in rows + gathers + norms:
            print(row, flush=True)
        print("stress (sums unequal to the fp32 rank-order sum, eager / graph):", stress, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    size = torch.cuda.device_count()  # every GPU a rank
    assert size >= 2, "needs 2 or more GPUs"
    out = out_path("symmetric_all_reduce.json")
    mp.spawn(worker, args=(size, free_port(), out), nprocs=size)


if __name__ == "__main__":
    main()
