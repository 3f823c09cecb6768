"""Engine-process throughput with EngineConfig.overlap_scheduling off vs on (not CI; no HTTP).

    python3 -m benchmarks.device.overlap [MODEL_DIR] [--rows 1,64,256] [--repeats 2]

The model folder is serve_bench.sh's random Llama-3-8B (`STAGES=model bash benchmarks/device/serve_bench.sh`).
For each setting an engine process is started behind tgi_compat.router.client.ZmqEngineClient (the server's own
client) and `rows` requests of 128 random prompt ids x 256 new tokens (ignore_eos) run at once; output
tok/s counts every token that reached the client, and the time per output token of a request is
(last token's arrival - first token's) / (tokens - 1), as a client sees it. With the overlap on, step
N+1 is scheduled and launched before step N's tokens are read back (tgi_compat/router/engine.py).

First (`--check`, on by default) a correctness check of the GPU path of overlap scheduling: a small
random Llama in float32 with CUDA graphs, in-process EngineCore, the same requests (greedy, seeded
sampling, top-n; all admitted in the first step and ended by length, so both settings run the same
plans) with overlap off and on: the tokens must be identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from benchmarks.device.engine_load import random_prompts, request, stream
from benchmarks.device.timing import out_path, write_json
from benchmarks.shapes import decoder
from tgi_compat.router.client import ZmqEngineClient
from tgi_compat.router.config import EngineConfig

PROMPT_LEN, NEW_TOKENS = 128, 256
TINY_LLAMA = decoder("LlamaForCausalLM", 256, 512, 2, 4, 2, 2000, max_position_embeddings=1024, rope_theta=10000.0)
TINY_LLAMA["rms_norm_eps"] = 1e-5


def check_same_tokens(device: str = "cuda") -> dict:
    """Overlap off vs on over one float32 runner (Triton backend, CUDA graphs); every token must match."""
    import torch

    from benchmarks.device.steps import build_runner, check_requests, engine_tokens, hf_model
    from tgi_compat.router.engine import EngineCore
    from tgi_compat.router.request import SamplingParams

    torch.manual_seed(0)
    model, hf_config = hf_model(TINY_LLAMA, torch.float32, device)
    backend = "triton" if device == "cuda" else "torch"  # (a CPU dry run of this script)
    runner = build_runner(hf_config, model.state_dict(), "float32", backend, 32, 512, device, [1, 2, 4, 8, 16, 32])
    rng = random.Random(0)
    requests = [
        (
            [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 60))],
            SamplingParams(do_sample=i % 3 == 1, seed=i, temperature=0.9, top_n_tokens=2 if i % 3 == 2 else 0),
            rng.randrange(1, 80),
        )
        for i in range(24)
    ]
    outputs = {}
    for overlap in (False, True):
        engine = EngineCore(
            EngineConfig(model_id="random", max_running_requests=32, overlap_scheduling=overlap),
            runner,
            runner.model_config,
        )
        outputs[overlap] = engine_tokens(engine, check_requests(requests))
        assert engine.pool.is_full_free()
    same = sum(outputs[False][k] == outputs[True].get(k) for k in outputs[False])
    lengths_ok = all(len(outputs[True][f"c{i}"]) == r[2] for i, r in enumerate(requests))
    result = dict(requests=len(requests), identical=same, lengths_ok=lengths_ok)
    print(json.dumps(dict(check=result)), flush=True)
    return result


async def measure(model_dir: str, overlap: bool, rows_list: list[int], repeats: int) -> list[dict]:
    client = await ZmqEngineClient.start(EngineConfig(model_id=model_dir, overlap_scheduling=overlap))
    rng, results = random.Random(0), []
    try:
        await asyncio.gather(*(stream(client, request(p, 16)) for p in random_prompts(rng, 16, PROMPT_LEN)))  # warm-up
        for rows, rep in ((rows, rep) for rows in rows_list for rep in range(repeats)):
            batch = random_prompts(rng, rows, PROMPT_LEN)
            start = time.perf_counter()
            streams = await asyncio.gather(*(stream(client, request(p, NEW_TOKENS)) for p in batch))
            seconds = time.perf_counter() - start
            tokens = sum(s.tokens for s in streams)
            result = dict(overlap=overlap, rows=rows, rep=rep, tokens=tokens, seconds=seconds, tok_s=tokens / seconds)
            result["median_tpot_ms"] = statistics.median(s.ms_per_token() for s in streams)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        await client.shutdown()
    return results


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?", default="/tmp/llama3-8b-random")
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-check", action="store_true", help="skip the tokens-match check")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = [] if args.no_check else [dict(check=check_same_tokens())]
    for overlap in (False, True, False, True):  # interleaved, so drift shows up as spread
        results += await measure(args.model_dir, overlap, rows, args.repeats)
    write_json(out_path("overlap.json"), results)


if __name__ == "__main__":
    asyncio.run(main())
