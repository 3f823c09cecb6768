"""Tensor-parallel serving on a multi-GPU host (random weights, no network), in one command:

    python3 -m benchmarks.device.tp            # 2 or 4 GPUs; writes $OUT/bench_tp.json after each part

1. Random Llama-3-8B: batch-1 time per output token and 64-stream output throughput at --num-shard 1
   and 2 (targets: TPOT(2) <= 0.62 x TPOT(1), throughput(2) >= 1.6 x throughput(1)); the two-GPU run once
   per all-reduce kernel in `--all-reduce` (default: the server's), as is the 70B-shaped run; `--wider 256` adds
   more stream counts (and their throughput ratios).
2. Random Llama-3-70B-shaped model (80 layers) at --num-shard 4 when there are 4 GPUs, else at 2 when
   two GPUs have room for its ~141 GB (H200s): batch-1 time per token against its memory roofline
   (weight + KV bytes one rank reads per token / measured copy bandwidth; target >= 80%).

No checkpoint is written: each model folder holds config.json and the Llama-3 tokenizer, and the
engine loads it with --load-format dummy (each rank makes its own shard of random weights on its GPU).
The engine runs as the server runs it (tgi_compat.router.client.ZmqEngineClient: rank 0 in the engine process,
ranks 1..N-1 beside it, NCCL, CUDA graphs), driven without HTTP so the numbers are the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.device.engine_load import request, stream
from benchmarks.device.timing import copy_bandwidth, out_path
from benchmarks.server_process import free_port
from benchmarks.shapes import LLAMA3_8B, LLAMA3_70B, attention_heads, projections
from tgi_compat.modeling.parallel.symmetric_all_reduce import KERNEL_ENV
from tgi_compat.router.client import ZmqEngineClient
from tgi_compat.router.config import EngineConfig

PROMPT_LEN, NEW_TOKENS, STREAMS = 128, 256, 64
WARMUP_TOKENS = 8  # enough to compile and autotune every step shape the measured run meets
# Besides its weight shard a rank needs its CUDA context, NCCL buffers, the activation and sampling
# reserve (tgi_compat.modeling.runner: ~8 GiB at 4096 prefill tokens and Llama-3's vocabulary) and some KV cache.
RANK_HEADROOM_BYTES = 16 * 2**30


def log(message: str) -> None:
    print(f"[bench_tp {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_config_folder(out_dir: Path, config: dict, tokenizer_from: Path | None = None) -> None:
    """config.json and the Llama-3 tokenizer (copied from tokenizer_from when given): all that
    --load-format dummy needs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, out_dir / name)
    elif not (out_dir / "tokenizer.json").exists():
        from benchmarks.llama3_tokenizer import write_llama3_tokenizer

        write_llama3_tokenizer(out_dir)
    hf_config = {**config, "torch_dtype": "bfloat16"}
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=1))


def matmul_bytes(config: dict, num_shard: int = 1) -> int:
    """bf16 bytes of one rank's matmul weights: every layer's projections and the LM head."""
    shapes = projections(config, num_shard)
    per_layer = sum(n * k for name, (n, k) in shapes.items() if name != "lm_head")
    return 2 * (config["num_hidden_layers"] * per_layer + shapes["lm_head"][0] * shapes["lm_head"][1])


def weight_bytes(config: dict) -> int:
    """bf16 bytes of the whole model: matmuls, the embedding and the norms."""
    hidden = config["hidden_size"]
    return matmul_bytes(config) + 2 * (config["vocab_size"] * hidden + (2 * config["num_hidden_layers"] + 1) * hidden)


def shards_for_70b(config: dict, num_gpus: int) -> int | None:
    """4 when there are 4 GPUs, else 2 when both GPUs have room for half the model; None: it does not fit."""
    for num_shard in (4, 2):
        if num_gpus < num_shard:
            continue
        need = weight_bytes(config) / num_shard + RANK_HEADROOM_BYTES
        free = [torch.cuda.mem_get_info(i)[0] for i in range(num_shard)]
        if min(free) >= need:
            return num_shard
        log(f"70B-shaped at {num_shard} shards needs {need / 1e9:.0f} GB per GPU, {min(free) / 1e9:.0f} GB free")
    return None


def bytes_per_token_per_rank(config: dict, num_shard: int, context: int) -> float:
    """What one rank reads from HBM per batch-1 decode step: its matmul weights and its KV heads."""
    _, kv_heads, head_dim = attention_heads(config, num_shard)
    return matmul_bytes(config, num_shard) + 2 * config["num_hidden_layers"] * kv_heads * head_dim * context * 2


async def measure(model_dir: Path, num_shard: int, streams: list[int]) -> dict:
    # tgi_compat.modeling.step_profiler: a folder per shard count and all-reduce kernel
    if profile_root := os.environ.get("TGI_PROFILE_ROOT"):
        run_name = f"tp{num_shard}-{os.environ.get(KERNEL_ENV, '1')}"
        os.environ["TGI_PROFILE_DIR"] = os.path.join(profile_root, run_name)
    config = EngineConfig(model_id=str(model_dir), num_shard=num_shard, master_port=free_port(), max_total_tokens=4096)
    config.load_format = "dummy"  # config.json + tokenizer only: each rank makes its shard of random weights
    config.max_running_requests = max(streams)  # CUDA graphs are captured up to this batch size only
    start = time.perf_counter()
    client = await ZmqEngineClient.start(config)
    result = {"num_shard": num_shard, "load_s": time.perf_counter() - start, "num_kv_slots": client.info.num_kv_slots}
    log(f"num_shard={num_shard}: engine up in {result['load_s']:.0f} s")
    try:
        for count in streams:  # warm-up at every measured width: compile, autotune, first graph replays
            await run_streams(client, count, WARMUP_TOKENS)
        for count in streams:
            times = await run_streams(client, count, NEW_TOKENS)
            gaps = [b - a for stream in times for a, b in zip(stream[1:], stream[2:])]
            wall = max(s[-1] for s in times) - min(s[0] for s in times)
            result[f"b{count}_tpot_ms"] = 1e3 * statistics.median(gaps)
            quantiles = statistics.quantiles(gaps, n=100)
            result[f"b{count}_gap_p90_p99_max_ms"] = [1e3 * quantiles[89], 1e3 * quantiles[98], 1e3 * max(gaps)]
            ttfts = sorted(stream[1] - stream[0] for stream in times)
            result[f"b{count}_ttft_p50_max_ms"] = [1e3 * statistics.median(ttfts), 1e3 * ttfts[-1]]
            result[f"b{count}_output_tok_s"] = count * NEW_TOKENS / wall
            log(f"num_shard={num_shard} streams={count}: {result}")
    finally:
        await client.shutdown()
    result["total_s"] = time.perf_counter() - start
    return result


async def run_streams(client: ZmqEngineClient, count: int, new_tokens: int) -> list[list[float]]:
    """Each stream's send time, then the arrival of each of its tokens."""

    def prompt(index: int) -> list[int]:
        return [(index * 7919 + i) % 100_000 + 1000 for i in range(PROMPT_LEN)]

    streams = await asyncio.gather(*(stream(client, request(prompt(i), new_tokens)) for i in range(count)))
    return [[s.sent, *s.event_times()] for s in streams]


def bench_8b(folder: Path, bandwidth: float, all_reduce_kernels: list[str], wider: list[int]) -> dict:
    """One GPU, then two GPUs with each all-reduce kernel (TGI_SYMMETRIC_ALL_REDUCE) in turn; `wider`: stream
    counts measured beside 1 and STREAMS."""
    widths = [1, STREAMS, *wider]
    one = asyncio.run(measure(folder, 1, widths))
    report = {
        "one_gpu": one,
        "roofline_b1_ms": {
            n: 1e3 * bytes_per_token_per_rank(LLAMA3_8B, n, PROMPT_LEN + NEW_TOKENS) / bandwidth for n in (1, 2)
        },
    }
    for kernel in all_reduce_kernels:
        os.environ[KERNEL_ENV] = kernel  # the engine's processes inherit it
        two = asyncio.run(measure(folder, 2, widths))
        report[f"two_gpus_{kernel}"] = {
            **two,
            "tpot_ratio": two["b1_tpot_ms"] / one["b1_tpot_ms"],  # target <= 0.62
            "throughput_ratio": two[f"b{STREAMS}_output_tok_s"] / one[f"b{STREAMS}_output_tok_s"],  # target >= 1.6
            **{f"throughput_ratio_b{n}": two[f"b{n}_output_tok_s"] / one[f"b{n}_output_tok_s"] for n in wider},
        }
    return report


def bench_70b(folder: Path, config: dict, num_shard: int, bandwidth: float, all_reduce_kernels: list[str]) -> dict:
    """Batch 1 at num_shard GPUs once per all-reduce kernel, against the memory roofline."""
    roofline_ms = 1e3 * bytes_per_token_per_rank(config, num_shard, PROMPT_LEN + NEW_TOKENS) / bandwidth
    report: dict = {"roofline_b1_ms": roofline_ms}
    for kernel in all_reduce_kernels:
        os.environ[KERNEL_ENV] = kernel
        result = asyncio.run(measure(folder, num_shard, [1]))
        report[kernel] = {**result, "pct_of_roofline": roofline_ms / result["b1_tpot_ms"]}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_tp"))
    parser.add_argument("--skip-8b", action="store_true", help="only the 70B-shaped model")
    parser.add_argument("--skip-70b", action="store_true", help="only the 8B at 1 and 2 GPUs")
    parser.add_argument("--layers-70b", type=int, default=80, help="fewer layers to save time; the roofline follows")
    parser.add_argument(
        "--all-reduce",
        nargs="+",
        default=["1"],
        help="the sharded runs once per symmetric all-reduce kernel (triton, torch; 0 = NCCL; 1 = the default)",
    )
    parser.add_argument(
        "--wider", type=int, nargs="*", default=[], help="more stream counts for the 8B at 1 and 2 GPUs, e.g. 256"
    )
    parser.add_argument("--json", default=out_path("bench_tp.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        parser.error(f"tensor parallelism needs 2 or more GPUs, this host has {num_gpus}")
    log(f"{num_gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    report: dict = {"gpus": num_gpus, "device": torch.cuda.get_device_name(0)}
    bandwidth = copy_bandwidth()  # on GPU 0
    torch.cuda.empty_cache()  # its buffers would hold GPU 0 memory that rank 0's KV pool needs
    report["copy_bandwidth_gb_s"] = bandwidth / 1e9

    def save(part: str) -> None:  # after each part: a run cut short still leaves what it measured
        report["elapsed_s"] = time.perf_counter() - started
        Path(args.json).write_text(json.dumps(report, indent=1))
        log(f"{part} done at {report['elapsed_s']:.0f} s; wrote {args.json}")

    llama8b = args.work_dir / "llama3-8b-dummy"
    write_config_folder(llama8b, LLAMA3_8B)
    if not args.skip_8b:
        report["llama3_8b"] = bench_8b(llama8b, bandwidth, args.all_reduce, args.wider)
        log(json.dumps(report["llama3_8b"], indent=1))
        save("Llama-3-8B")
    if not args.skip_70b:
        config = {**LLAMA3_70B, "num_hidden_layers": args.layers_70b}
        num_shard = shards_for_70b(config, num_gpus)
        if num_shard is None:
            log(f"skipping the 70B-shaped model: {weight_bytes(config) / 1e9:.0f} GB fits neither 4 GPUs nor 2")
        else:
            llama70b = args.work_dir / f"llama3-70b-{args.layers_70b}l-dummy"
            write_config_folder(llama70b, config, tokenizer_from=llama8b)
            log(f"70B-shaped ({args.layers_70b} layers, {weight_bytes(config) / 1e9:.0f} GB) at {num_shard} shards")
            report["llama3_70b"] = bench_70b(llama70b, config, num_shard, bandwidth, args.all_reduce)
            log(json.dumps(report["llama3_70b"], indent=1))
    save("all")


if __name__ == "__main__":
    main()
