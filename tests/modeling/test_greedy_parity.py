"""Greedy decoding through ModelRunner (one prefill, then one decode step per token) picks the
same ids as transformers' generate on the same GGUF, for a dozen prompts."""

from __future__ import annotations

from tests.modeling.helpers import transformers_greedy
from tgi_compat.modeling.forward_batch import build_forward_batch

MAX_NEW_TOKENS = 10
EOS_TOKEN_ID = 2  # <|im_end|>
# (five: the engine's own test, tests/router/test_smollm2_engine.py, compares twelve others with generate)
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "In machine learning, a transformer is",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n",
]


def greedy_with_runner(runner, prompt_ids: list[int], row: int) -> list[int]:
    n = len(prompt_ids)
    slots = list(range(row * 256, row * 256 + n + MAX_NEW_TOKENS))
    logits = runner.forward(build_forward_batch(prompt_ids, [row], [n], [n], slots[:n], [n - 1]))
    generated = [int(logits.argmax(-1))]
    for step in range(MAX_NEW_TOKENS - 1):
        if generated[-1] == EOS_TOKEN_ID:
            break
        position = n + step
        batch = build_forward_batch([generated[-1]], [row], [1], [position + 1], [slots[position]], [0])
        generated.append(int(runner.forward(batch).argmax(-1)))
    return generated


def test_greedy_ids_match_transformers_generate(smollm2_runner, smollm2_hf_model, smollm2_tokenizer):
    mismatches = []
    for row, text in enumerate(PROMPTS):
        ids = smollm2_tokenizer(text).input_ids
        ours = greedy_with_runner(smollm2_runner, ids, row % smollm2_runner.max_rows)
        theirs = transformers_greedy(smollm2_hf_model, ids, EOS_TOKEN_ID, MAX_NEW_TOKENS)
        if ours != theirs:
            mismatches.append((text, ours, theirs))
    assert not mismatches, mismatches
