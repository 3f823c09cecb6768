"""Speculation is lossless at scale (issue 40): `--speculate 4` against `--speculate 0` on 50 chat prompts x 256
new tokens of the embedded SmolLM2, greedy and seeded sampling, 32 requests running at once and each alone.

    .venv/bin/python -m benchmarks.spec_equality [--prompts 50] [--new-tokens 256] [--out spec_equality.json]

The prompts are half code-edit (a ~250-token source file of this repo and a rename instruction: drafts get
accepted) and half summarise-this-section (docs of this repo). The reference is the plain engine with 32 running;
the speculating engine must give the same token ids (so the same text) batched and alone, and its KV pool must be
whole again after each run. CPU, minutes (not CI: the router tests run the same check on 8 prompts x 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.cpu_engine import model_path
from benchmarks.spec_acceptance import REPO, _chat_text, _truncate
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.offline import LLM
from tgi_compat.router.request import SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig

SOURCE_TOKENS = 250
SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=5),
}


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts' ids: code-edit ones over the router's modules, then summaries of doc sections."""
    texts = []
    for path in sorted((REPO / "tgi_compat/router").glob("*.py"))[: count // 2]:
        source = _truncate(tokenizer, path.read_text(), SOURCE_TOKENS)
        texts.append(
            f"```python\n{source}\n```\n\nRename every `self` in this code to `this`. Reply with the code only."
        )
    for path in ("README.md", "docs/architecture.md", "docs/contract.md"):
        for section in (REPO / path).read_text().split("\n## ")[1:]:
            if len(texts) < count:
                texts.append(f"{_truncate(tokenizer, section, SOURCE_TOKENS)}\n\nSummarise the section above.")
    chats = [[{"role": "user", "content": text}] for text in texts]
    return [tokenizer.encode(_chat_text(tokenizer, chat), add_special_tokens=False) for chat in chats]


def run(llm: LLM, prompts: list[list[int]], sampling: SamplingParams, new_tokens: int, alone: bool) -> dict:
    start = time.perf_counter()
    if alone:
        results = [r for p in prompts for r in llm.generate([p], sampling, max_new_tokens=new_tokens)]
    else:
        results = llm.generate(prompts, sampling, max_new_tokens=new_tokens)
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return dict(
        ids=[r.token_ids for r in results],
        seconds=time.perf_counter() - start,
        pool_whole=llm.engine.pool.is_full_free(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default="spec_equality.json")
    args = parser.parse_args()
    from tgi_compat.modeling.tokenizer import load_tokenizer

    path = model_path()
    prompts = chat_prompts(load_tokenizer(path), args.prompts)
    config = dict(model_id=path, max_batch_total_tokens=24576, max_running_requests=32)
    plain = LLM(EngineConfig(**config))
    speculating = LLM(EngineConfig(**config, speculative=SpeculativeConfig(num_speculative_tokens=4)))
    counters = speculating.engine.scheduler.speculator.counters
    rows = []
    print("| sampling | run | tokens | equal to --speculate 0 | KV pool whole | seconds |")
    print("|---|---|---:|---|---|---:|")
    for name, sampling in SAMPLINGS.items():
        reference = run(plain, prompts, sampling, args.new_tokens, alone=False)
        for label, llm, alone in (
            ("speculate 4, 32 at once", speculating, False),
            ("speculate 4, alone", speculating, True),
        ):
            accepted = counters.num_accepted_tokens
            got = run(llm, prompts, sampling, args.new_tokens, alone)
            equal = sum(a == b for a, b in zip(got["ids"], reference["ids"]))
            tokens = sum(map(len, got["ids"]))
            row = dict(
                sampling=name,
                run=label,
                prompts=len(prompts),
                tokens=tokens,
                equal=equal,
                accepted_drafts=counters.num_accepted_tokens - accepted,
                pool_whole=got["pool_whole"],
                seconds=round(got["seconds"], 1),
                plain_seconds=round(reference["seconds"], 1),
            )
            rows.append(row)
            print(f"| {name} | {label} | {tokens} | {equal}/{len(prompts)} | {got['pool_whole']} | {row['seconds']} |")
    with open(args.out, "w") as f:
        json.dump(dict(prompt_lens=[len(p) for p in prompts], new_tokens=args.new_tokens, rows=rows), f, indent=1)
    assert all(r["equal"] == r["prompts"] and r["pool_whole"] for r in rows), "speculation changed an output"


if __name__ == "__main__":
    main()
