"""Tensor-parallel serving on a multi-GPU host (random weights, no network), in one command:

    python scripts/device/bench_tp.py            # needs 4 GPUs (2 for --skip-70b); writes $OUT/bench_tp.json

1. Random Llama-3-8B: batch-1 time per output token and 64-stream output throughput at --num-shard 1
   and 2 (targets: TPOT(2) <= 0.62 x TPOT(1), throughput(2) >= 1.6 x throughput(1)).
2. Random Llama-3-70B-shaped model at --num-shard 4: batch-1 time per token against its memory
   roofline (weight + KV bytes one rank reads per token / measured copy bandwidth; target >= 80%).

The engine runs as the server runs it (router.client.ZmqEngineClient: rank 0 in the engine process,
ranks 1..N-1 beside it, NCCL, CUDA graphs), driven without HTTP so the numbers are the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from router.client import ZmqEngineClient
from router.config import EngineConfig
from router.request import GenerateRequest

PROMPT_LEN, NEW_TOKENS, STREAMS = 128, 256, 64
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28_672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8)  # fmt: skip


def log(message: str) -> None:
    print(f"[bench_tp {time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy on GPU 0 (read + write), the roofline's bandwidth."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**31 / seconds


def write_70b_shaped(out_dir: Path, num_layers: int) -> None:
    """Llama-3-70B shapes with random bf16 weights, written tensor by tensor (never 140 GB in memory)."""
    from safetensors.torch import save_file

    from benchmarks.llama3_tokenizer import write_llama3_tokenizer
    from benchmarks.random_model import PRESETS

    config = {**PRESETS["llama3-8b"], **LLAMA3_70B, "num_hidden_layers": num_layers}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_llama3_tokenizer(out_dir)
    (out_dir / "config.json").write_text(
        json.dumps({**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"})
    )
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda:0", dtype=torch.bfloat16) * 0.02).cpu()

    save_file({"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden).bfloat16(),
               "lm_head.weight": rand(vocab, hidden)}, out_dir / "model-top.safetensors")  # fmt: skip
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        tensors = {
            p + "self_attn.q_proj.weight": rand(hidden, hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, hidden),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
        }
        save_file(tensors, out_dir / f"model-{layer:03d}.safetensors")
    torch.cuda.empty_cache()


def bytes_per_token_per_rank(config: dict, num_shard: int, context: int) -> float:
    """What one rank reads from HBM per batch-1 decode step: its weight shard and its KV heads."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter
    weights = (layers * per_layer + config["vocab_size"] * hidden) * 2 / num_shard
    kv_cache = 2 * layers * kv * context * 2 / num_shard
    return weights + kv_cache


async def measure(model_dir: Path, num_shard: int, streams: list[int]) -> dict:
    if profile_root := os.environ.get("TGI_PROFILE_ROOT"):  # modeling.step_profiler, one folder per shard count
        os.environ["TGI_PROFILE_DIR"] = os.path.join(profile_root, f"tp{num_shard}")
    config = EngineConfig(model_id=str(model_dir), num_shard=num_shard, master_port=free_port(), max_total_tokens=4096)
    start = time.perf_counter()
    client = await ZmqEngineClient.start(config)
    result = {"num_shard": num_shard, "load_s": time.perf_counter() - start, "num_kv_slots": client.info.num_kv_slots}
    try:
        for count in streams:  # warm-up at every measured width: compile, autotune, first graph replays
            await run_streams(client, count, 32)
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
    return result


async def run_streams(client: ZmqEngineClient, count: int, new_tokens: int) -> list[list[float]]:
    async def one(index: int) -> list[float]:
        prompt = [(index * 7919 + i) % 100_000 + 1000 for i in range(PROMPT_LEN)]
        request = GenerateRequest(
            f"bench-{index}-{time.monotonic_ns()}", prompt, max_new_tokens=new_tokens, ignore_eos=True
        )
        stamps = [time.perf_counter()]
        async for _ in client.generate(request):
            stamps.append(time.perf_counter())
        return stamps

    return await asyncio.gather(*(one(i) for i in range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_tp"))
    parser.add_argument("--skip-70b", action="store_true")
    parser.add_argument("--layers-70b", type=int, default=80, help="fewer layers to save time; the roofline follows")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_tp.json"))
    args = parser.parse_args()
    num_gpus = torch.cuda.device_count()
    log(f"{num_gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    report: dict = {"gpus": num_gpus, "device": torch.cuda.get_device_name(0)}
    bandwidth = copy_bandwidth()
    report["copy_bandwidth_gb_s"] = bandwidth / 1e9

    from benchmarks.random_model import PRESETS, write_random_llama

    llama8b = args.work_dir / "llama3-8b"
    if not (llama8b / "config.json").exists():
        log("writing random Llama-3-8B")
        write_random_llama(llama8b, "llama3-8b", device="cuda")
        torch.cuda.empty_cache()
    one = asyncio.run(measure(llama8b, 1, [1, STREAMS]))
    two = asyncio.run(measure(llama8b, 2, [1, STREAMS]))
    report["llama3_8b"] = {
        "one_gpu": one,
        "two_gpus": two,
        "tpot_ratio": two["b1_tpot_ms"] / one["b1_tpot_ms"],  # target <= 0.62
        "throughput_ratio": two[f"b{STREAMS}_output_tok_s"] / one[f"b{STREAMS}_output_tok_s"],  # target >= 1.6
        "roofline_b1_ms": {
            n: 1e3 * bytes_per_token_per_rank(PRESETS["llama3-8b"], n, PROMPT_LEN + NEW_TOKENS) / bandwidth
            for n in (1, 2)
        },
    }
    log(json.dumps(report["llama3_8b"], indent=1))
    if not args.skip_70b and num_gpus >= 4:
        llama70b = args.work_dir / f"llama3-70b-{args.layers_70b}l"
        if not (llama70b / "config.json").exists():
            log(f"writing random Llama-3-70B-shaped model ({args.layers_70b} layers)")
            write_70b_shaped(llama70b, args.layers_70b)
        four = asyncio.run(measure(llama70b, 4, [1]))
        config = {**PRESETS["llama3-8b"], **LLAMA3_70B, "num_hidden_layers": args.layers_70b}
        roofline_ms = 1e3 * bytes_per_token_per_rank(config, 4, PROMPT_LEN + NEW_TOKENS) / bandwidth
        report["llama3_70b"] = {
            **four,
            "roofline_b1_ms": roofline_ms,
            "pct_of_roofline": roofline_ms / four["b1_tpot_ms"],
        }
        log(json.dumps(report["llama3_70b"], indent=1))
    Path(args.json).write_text(json.dumps(report, indent=1))
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
