"""Prompts of an exact token count, made of random whole words.

Byte-level BPE tokenizers (GPT-2, Llama-3, SmolLM2, Qwen) split text on words before merging, and a
word with its leading space (" hello") that is one vocabulary entry always encodes to that one token.
A prompt of N such words is therefore exactly N tokens. Words are drawn at random per prompt so that
prompts share no long prefix (a prefix cache must not turn the benchmark into a cache test).
"""

from __future__ import annotations

import numpy as np

_POOL_SIZE = 4096


class PromptSynthesizer:
    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.words = self._single_token_words()
        # Tokens the tokenizer adds around any text (BOS), counted once per prompt.
        self.num_special = len(tokenizer("").input_ids)

    def _single_token_words(self) -> list[str]:
        candidates = []
        for token_id in range(min(len(self.tokenizer), 60_000)):
            text = self.tokenizer.decode([token_id])
            word = text[1:]
            if text.startswith(" ") and word.isascii() and word.isalpha() and 3 <= len(word) <= 10:
                candidates.append(text)
            if len(candidates) >= 4 * _POOL_SIZE:
                break
        ids = self.tokenizer(candidates, add_special_tokens=False).input_ids
        words = [w for w, i in zip(candidates, ids) if len(i) == 1]
        if len(words) < 100:
            raise ValueError("tokenizer has too few single-token words to synthesize prompts")
        return words[:_POOL_SIZE]

    def count(self, text: str) -> int:
        return len(self.tokenizer(text).input_ids)

    def make(self, num_tokens: int) -> str:
        """A prompt that encodes to ``num_tokens`` text tokens (plus the tokenizer's specials)."""
        picks = self.rng.integers(0, len(self.words), size=num_tokens)
        text = "".join(self.words[i] for i in picks)
        actual = self.count(text) - self.num_special
        if actual != num_tokens:  # cannot happen for byte-level BPE; fail loudly if it does
            raise ValueError(f"synthesized prompt has {actual} tokens, wanted {num_tokens}")
        return text
