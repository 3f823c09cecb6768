"""An EAGLE-3 head's drafting time, as the engine measures it at startup for the draft-length policy
(tgi_compat/modeling/step_cost.py: measure_head_costs): a random head of Llama-3-8B's shape (one layer, a 32000-token
draft vocabulary, speculators format: benchmarks/eagle3_head.py) over a random bf16 embedding of the target's
vocabulary. Per batch size B: the fold forward (the target's hidden states in: fixed per drafting step), one draft
forward, and k = 4 drafts in all, against the ~4 ms of a Llama-3-8B decode step on an H200.

    python3 -m benchmarks.device.head_cost [--device cpu]   (~1 min on an H200; cpu: a tiny head, seconds)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.device.timing import out_path, write_json
from benchmarks.eagle3_head import write_random_eagle3_head
from benchmarks.shapes import LLAMA3_8B, LLAMA3_TINY
from tgi_compat.modeling.models.eagle3 import load_eagle3_head
from tgi_compat.modeling.step_cost import HEAD_COST_BATCHES, HEAD_COST_BATCHES_CPU, measure_head_costs

NUM_DRAFTS = 4


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/head-cost-bench"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None, help="JSON results (default $OUT/head_cost.json)")
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    target, draft_vocab = (LLAMA3_8B, 32000) if on_gpu else (LLAMA3_TINY, 1024)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    device = torch.device(args.device)
    folder = write_random_eagle3_head(args.work_dir / f"eagle3-{draft_vocab}", target, draft_vocab)
    vocab, hidden = target["vocab_size"], target["hidden_size"]
    embedding = (torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.02).to(device, dtype)
    head = load_eagle3_head(str(folder), vocab, embedding, device, dtype)
    batches, fixed, per_draft = measure_head_costs(head, HEAD_COST_BATCHES if on_gpu else HEAD_COST_BATCHES_CPU)
    rows = []
    print(f"\nEAGLE-3 head of {'Llama-3-8B' if on_gpu else 'a tiny Llama'}'s shape on {args.device} ({dtype})")
    print(f"| batch | fold ms | per draft ms | k={NUM_DRAFTS} ms |")
    print("|---:|---:|---:|---:|")
    for b, f, d in zip(batches, fixed, per_draft):
        total = f + NUM_DRAFTS * d
        rows.append(dict(batch=b, fold_s=f, per_draft_s=d, drafting_s=total))
        print(f"| {b} | {1e3 * f:.3f} | {1e3 * d:.3f} | {1e3 * total:.3f} |")
    report = dict(device=args.device, draft_vocab=draft_vocab, num_drafts=NUM_DRAFTS, rows=rows)
    write_json(args.out or out_path("head_cost.json"), report)
    return report


if __name__ == "__main__":
    main()
