"""Speculative decoding on the GPU against the issue-40 bars (not CI; no HTTP).

    python3 -m benchmarks.device.speculative [--work-dir /tmp/spec-bench] [--device cuda] [--method eagle3]

A random Llama-3-8B in bf16 (`--load-format dummy`: config.json and the Llama-3 tokenizer, weights made on the
device), served by an engine process behind the server's own client (tgi_compat.router.client.ZmqEngineClient),
once with `--speculate 0` and once with 4 n-gram drafts whose acceptance is replayed from the code-edit
workload's measured accepted-length histogram (SmolLM2-135M, n-gram 1..4, k = 4:
docs/benchmarks/2026-12-04-spec-acceptance.json) through synthetic acceptance: random weights match no
n-gram. Each engine measures its step-cost table at startup and replays verify steps from CUDA graphs.

Workloads (every request ignore_eos): batch 1 and 16 streams of the code-edit shape (a 550-token prompt,
256 new tokens), and 64 streams of ShareGPT lengths (random ids, outputs capped at 384), where the measured
table should turn drafts off where they lose. Output tok/s counts every token that reached the client. Every timed
row runs right after a warm-up of its own shape on its engine (the same lengths, other ids: nothing for the prefix
cache to share; every row's ids are its own), so a row is never timed cold on one engine and warm on another (the
zero-acceptance row has an engine of its own on the speculative side, and follows "ShareGPT, 64 streams" on the
plain one); the warm-up also lets the speculative engine learn its workload's acceptance, as a server in steady
state has.
Bars: batch 1 >= 2.0x, 16 streams >= 1.3x, 64 streams >= 0.98x. `--device cpu`: a tiny Llama on the CPU,
a few tokens each (a dry run of this script's path, used by a CPU test).

`--method eagle3`: the drafts come from a random EAGLE-3 head of Llama-3-8B's shape (one layer, a 32000-token
draft vocabulary, speculators format: benchmarks/eagle3_head.py), run eagerly per request after every step, with
the same replayed acceptance: the ratio against the n-gram run is what the head costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from benchmarks.device.engine_load import request, stream
from benchmarks.device.timing import out_path, write_json
from benchmarks.eagle3_head import write_random_eagle3_head
from benchmarks.shapes import LLAMA3_8B, LLAMA3_TINY
from tgi_compat.router.client import ZmqEngineClient
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.synthetic import SyntheticAcceptance

ACCEPTANCE_FILE = Path(__file__).resolve().parents[2] / "docs/benchmarks/2026-12-04-spec-acceptance.json"
PROPOSER = "ngram 1..4 (vLLM-style, latest)"
NUM_DRAFTS = 4


@dataclass(frozen=True)
class Workload:
    name: str
    streams: int
    prompt_len: int | None  # None: ShareGPT lengths
    new_tokens: int  # (the cap, for ShareGPT)
    bar: float  # speculation's tok/s over --speculate 0's must reach this
    # the acceptance replayed: the code-edit measurement, or none (every draft rejected: the step-cost policy
    # must turn drafting off)
    accepted: str = "code-edit"


GPU_WORKLOADS = [
    Workload("code-edit, batch 1", 1, 550, 256, 2.0),
    Workload("code-edit, 16 streams", 16, 550, 256, 1.3),
    Workload("ShareGPT, 64 streams", 64, None, 384, 0.98),
    Workload("ShareGPT, 64 streams, no draft accepted", 64, None, 384, 0.98, accepted="none"),
]
CPU_WORKLOADS = [
    Workload("code-edit, batch 1", 1, 40, 12, 0.0),
    Workload("code-edit, 4 streams", 4, 40, 12, 0.0),
    Workload("ShareGPT, 8 streams", 8, None, 12, 0.0),
    Workload("ShareGPT, 8 streams, no draft accepted", 8, None, 12, 0.0, accepted="none"),
]


def code_edit_histogram(path: Path = ACCEPTANCE_FILE) -> list[float]:
    """Accepted drafts per verify step (0..4) of the code-edit workload, SmolLM2, n-gram 1..4, k = 4."""
    runs = json.loads(path.read_text())["smollm2"]["code-edit"]["proposers"][PROPOSER]
    return [float(n) for n in next(run for run in runs if run["k"] == NUM_DRAFTS)["histogram"]]


def write_model_folder(folder: Path, config: dict) -> Path:
    """config.json and the Llama-3 tokenizer: all that --load-format dummy needs."""
    from benchmarks.llama3_tokenizer import write_llama3_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "tokenizer.json").exists():
        write_llama3_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
    return folder


def prompts_of(workload: Workload, seed: int, ids_seed: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per stream: lengths from `seed`, random ids from `ids_seed` (default: `seed`;
    nothing for a prefix cache to share)."""
    rng = random.Random(seed if ids_seed is None else ids_seed)
    if workload.prompt_len is not None:
        lengths = [(workload.prompt_len, workload.new_tokens)] * workload.streams
    else:
        from benchmarks.device.offline_engine import sharegpt_lengths

        lengths = [(p, min(o, workload.new_tokens)) for p, o in sharegpt_lengths(workload.streams, seed)]
    return [([rng.randrange(1000, 100_000) for _ in range(p)], max(o, 1)) for p, o in lengths]


async def measure(config: EngineConfig, workloads: list[Workload], tag: str) -> dict[str, dict]:
    start = time.perf_counter()
    client = await ZmqEngineClient.start(config)
    print(f"[{tag}] engine up in {time.perf_counter() - start:.0f} s", flush=True)
    results = {}
    try:
        for workload in workloads:
            # each row's own ids (the same on every engine), so that no timed row finds an earlier row's prompts in
            # the prefix cache: the two 64-stream rows share their lengths, and with one seed they shared their ids
            # too, which gave the plain engine's zero-acceptance row cache hits the speculative one never had
            # (session 25: 0.86x against it, 0.98x against the same prompts uncached)
            ids = zlib.crc32(workload.name.encode())
            await run_streams(client, prompts_of(workload, seed=2, ids_seed=ids + 1))  # the warm-up: this row's shape
            tokens, seconds = await run_streams(client, prompts_of(workload, seed=2, ids_seed=ids))
            results[workload.name] = dict(tokens=tokens, seconds=seconds, tok_s=tokens / seconds)
            print(json.dumps(dict(engine=tag, workload=workload.name, **results[workload.name])), flush=True)
    finally:
        await client.shutdown()
    return results


async def run_streams(client: ZmqEngineClient, prompts: list[tuple[list[int], int]]) -> tuple[int, float]:
    """Every (prompt, new tokens) streamed at once -> (tokens that reached the client, seconds)."""
    start = time.perf_counter()
    streams = await asyncio.gather(*(stream(client, request(p, n)) for p, n in prompts))
    return sum(s.tokens for s in streams), time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> dict:
    on_gpu = args.device == "cuda"
    folder = write_model_folder(
        args.work_dir / ("llama3-8b-dummy" if on_gpu else "llama3-tiny-dummy"), LLAMA3_8B if on_gpu else LLAMA3_TINY
    )
    workloads = GPU_WORKLOADS if on_gpu else CPU_WORKLOADS
    base = dict(
        model_id=str(folder),
        load_format="dummy",
        device=args.device,
        max_running_requests=64,  # (the decode graphs are captured up to this batch)
        max_total_tokens=2048,
        max_batch_prefill_tokens=8192,
    )
    if not on_gpu:
        base |= dict(dtype="float32", max_batch_total_tokens=8192)
    histogram = code_edit_histogram()
    histograms = {"code-edit": histogram, "none": [1.0] + [0.0] * NUM_DRAFTS}
    drafts_from: dict = {}  # n-gram; or a random EAGLE-3 head's
    if args.method == "eagle3":
        target, draft_vocab = (LLAMA3_8B, 32000) if on_gpu else (LLAMA3_TINY, 1024)
        head = write_random_eagle3_head(args.work_dir / f"eagle3-{draft_vocab}", target, draft_vocab)
        drafts_from = dict(method="eagle3", draft_model=str(head))
    plain = plain_from(args.plain_from, args.device, workloads) or await measure(
        EngineConfig(**base), workloads, "speculate 0"
    )
    spec = {}
    for accepted, replayed in histograms.items():
        acceptance = SyntheticAcceptance(tuple(replayed))
        speculative = SpeculativeConfig(NUM_DRAFTS, synthetic_acceptance=acceptance, **drafts_from)
        mine = [workload for workload in workloads if workload.accepted == accepted]
        tag = f"{args.method} {NUM_DRAFTS}, {accepted} accepted"
        spec |= await measure(EngineConfig(**base, speculative=speculative), mine, tag)
    rows = []
    print(f"\nacceptance replayed: {PROPOSER}, k = {NUM_DRAFTS}, histogram {histogram}; drafts: {args.method}")
    print(f"| workload | --speculate 0 tok/s | {args.method} k={NUM_DRAFTS} tok/s | ratio | bar | pass |")
    print("|---|---:|---:|---:|---:|---|")
    for workload in workloads:
        off, on = plain[workload.name]["tok_s"], spec[workload.name]["tok_s"]
        ratio = on / off
        rows.append(dict(workload=workload.name, off_tok_s=off, on_tok_s=on, ratio=ratio, bar=workload.bar))
        verdict = "PASS" if ratio >= workload.bar else "FAIL"
        print(f"| {workload.name} | {off:.1f} | {on:.1f} | {ratio:.2f}x | >= {workload.bar}x | {verdict} |")
    return dict(device=args.device, method=args.method, histogram=histogram, rows=rows, plain=plain, speculative=spec)


def plain_from(path: Path | None, device: str, workloads: list[Workload]) -> dict[str, dict] | None:
    """The --speculate 0 numbers of an earlier run's JSON (the same device and workloads), or None."""
    if path is None:
        return None
    earlier = json.loads(path.read_text())
    missing = {w.name for w in workloads} - set(earlier["plain"])
    if earlier["device"] != device or missing:
        raise SystemExit(f"{path}: a run on {earlier['device']}, without the workloads {sorted(missing)}")
    print(f"[speculate 0] from {path}", flush=True)
    return earlier["plain"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/spec-bench"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--method", default="ngram", choices=["ngram", "eagle3"], help="the drafts' proposer")
    parser.add_argument("--out", default=None, help="JSON results (default $OUT/speculative[-eagle3].json)")
    parser.add_argument(
        "--plain-from", type=Path, default=None, help="an earlier run's JSON: its --speculate 0 numbers (not run again)"
    )
    args = parser.parse_args(argv)
    report = asyncio.run(main_async(args))
    suffix = "" if args.method == "ngram" else f"-{args.method}"
    write_json(args.out or out_path(f"speculative{suffix}.json"), report)
    return report


if __name__ == "__main__":
    main()
