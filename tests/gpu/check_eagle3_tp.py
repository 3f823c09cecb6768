"""GPU check (not CI) of EAGLE-3 under tensor parallelism, through what CI's gloo test (tests/router/test_spec_eagle3.py)
cannot reach: NCCL, the symmetric-memory all-reduce fused with the norm (whose output the head reads), decode and
verify steps replayed from CUDA graphs. A tiny random Llama target and a tiny random head: greedy and seeded output at
TP=2 with the head must be TP=2's `--speculate 0`, token for token, with drafts made and the KV pool full again after.
One GPU's head runs beside for its counters (as many drafted and accepted at TP=2: reported, not required, since the
ranks' sums round differently). bfloat16 by default (the Triton all-reduce takes 16-bit sums); exits non-zero on a miss.

Run on a 2-GPU device:  PYTHONPATH=$PWD python3 -m tests.gpu.check_eagle3_tp [--dtype float32]   (about 2 minutes)
`--device cpu` runs the same over gloo: a smoke test of this script.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.benchmarks.conftest import free_port
from tests.modeling.eagle3_heads import DRAFT_VOCAB, TARGET, random_head_tensors, save_head
from tests.router.sharded_engine import generate, sharded_engine
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.process_exit import exit_process
from tgi_compat.router.request import SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig

SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=7),
}
PROMPTS = {i: [1 + (i * 37 + j * 11) % 250 for j in range(3 + 17 * i)] for i in range(6)}
MAX_NEW_TOKENS = 48
CASES = {"tp2-plain": (2, False), "tp2-eagle3": (2, True), "tp1-eagle3": (1, True)}  # (ranks, with the head)


def serve(config: EngineConfig, out: str) -> None:
    """One case in its own process (a spawn target), whose exit leaves the NCCL group; saves its outputs."""
    with sharded_engine(config) as engine:
        results = {name: generate(engine, PROMPTS, sampling, MAX_NEW_TOKENS) for name, sampling in SAMPLINGS.items()}
        speculator = engine.scheduler.speculator
        counters = None if speculator is None else speculator.counters
    torch.save({"outputs": results, "counters": counters}, out)
    exit_process(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.device == "cuda":
        assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
    from transformers import LlamaConfig, LlamaForCausalLM

    started, work = time.perf_counter(), Path(tempfile.mkdtemp(prefix="eagle3-tp-"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TARGET, bos_token_id=1, eos_token_id=2)).save_pretrained(work / "target")
    head = save_head(work / "head", "speculators", random_head_tensors(seed=1) | {"d2t": torch.arange(DRAFT_VOCAB) * 3})
    results = {}
    for case, (ranks, drafts) in CASES.items():
        speculative = SpeculativeConfig(num_speculative_tokens=3, method="eagle3", draft_model=head) if drafts else None
        config = EngineConfig(
            model_id=str(work / "target"),
            device=args.device,
            dtype=args.dtype,
            max_batch_total_tokens=4096,
            max_running_requests=8,
            speculative=speculative,
            num_shard=ranks,
            master_port=free_port(),
        )
        process = multiprocessing.get_context("spawn").Process(target=serve, args=(config, str(work / f"{case}.pt")))
        process.start()
        process.join()
        if process.exitcode != 0:
            print(f"{case}: exit code {process.exitcode} MISS", flush=True)
            return 1
        results[case] = torch.load(work / f"{case}.pt", weights_only=False)
        print(f"{case}: {results[case]['counters']} ({time.perf_counter() - started:.0f} s)", flush=True)
    ok = True
    for name in SAMPLINGS:
        same = results["tp2-eagle3"]["outputs"][name] == results["tp2-plain"]["outputs"][name]
        ok &= same
        print(f"{args.dtype} {name}: TP=2 with the head vs TP=2 --speculate 0: {'ok' if same else 'MISS'}", flush=True)
    ours, one_gpu = results["tp2-eagle3"]["counters"], results["tp1-eagle3"]["counters"]
    ok &= ours.num_draft_tokens > 0
    print(
        f"drafted / accepted: TP=2 {ours.num_draft_tokens} / {ours.num_accepted_tokens}, one GPU "
        f"{one_gpu.num_draft_tokens} / {one_gpu.num_accepted_tokens} {'ok' if ours.num_draft_tokens else 'MISS'}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
