"""Engine-process throughput with EngineConfig.overlap_host_io off vs on (not CI; no HTTP).

    python3 scripts/device/bench_overlap.py [MODEL_DIR] [--rows 64,256] [--repeats 2]

The model folder is serve_bench.sh's random Llama-3-8B (`STAGES=model bash scripts/device/serve_bench.sh`).
For each setting an engine process is started behind router.client.ZmqEngineClient (the server's own
client) and `rows` requests of 128 random prompt ids x 256 new tokens (ignore_eos) run at once; output
tok/s counts every token that reached the client. With the overlap on, the engine process sends a
step's events and reads new messages while the GPU runs the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from router.client import ZmqEngineClient  # noqa: E402
from router.config import EngineConfig  # noqa: E402
from router.request import GenerateRequest  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 128, 256


async def measure(model_dir: str, overlap: bool, rows_list: list[int], repeats: int) -> list[dict]:
    client = await ZmqEngineClient.start(EngineConfig(model_id=model_dir, overlap_host_io=overlap))
    rng, ids, results = random.Random(0), iter(range(10**9)), []

    async def one(prompt: list[int], new_tokens: int) -> int:
        request = GenerateRequest(f"q{next(ids)}", prompt, max_new_tokens=new_tokens, ignore_eos=True)
        return sum([len(e.token_ids) async for batch in client.generate_batches(request) for e in batch])

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(1000, 100000) for _ in range(PROMPT_LEN)] for _ in range(n)]

    try:
        await asyncio.gather(*(one(p, 16) for p in prompts(16)))  # warm-up
        for rows in rows_list:
            for rep in range(repeats):
                batch = prompts(rows)
                start = time.perf_counter()
                tokens = sum(await asyncio.gather(*(one(p, NEW_TOKENS) for p in batch)))
                seconds = time.perf_counter() - start
                result = dict(overlap=overlap, rows=rows, rep=rep, tokens=tokens, seconds=seconds, tok_s=tokens / seconds)
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        await client.shutdown()
    return results


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?", default="/tmp/llama3-8b-random")
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for overlap in (False, True, False, True):  # interleaved, so drift shows up as spread
        results += await measure(args.model_dir, overlap, rows, args.repeats)
    with open(os.path.join(os.environ.get("OUT", "."), "overlap.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
