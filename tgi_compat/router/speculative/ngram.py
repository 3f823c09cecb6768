"""N-gram / prompt-lookup drafts: find the request's last n tokens earlier in its own sequence and propose
what followed them there (vLLM's `ngram` method; TGI's `--speculate N` without Medusa heads).

An index from each n-gram (n in [min_n, max_n]) to where its continuation starts is kept up to date as
tokens arrive, so a step costs O(max_n) dict lookups whatever the sequence length (vLLM scans the whole
sequence each step). The longest matching n wins; among its occurrences the most recent one, or the
first one (`first_match`, TGI's rule for n = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NgramConfig:
    min_n: int = 1  # vLLM prompt_lookup_min
    max_n: int = 4  # vLLM prompt_lookup_max
    first_match: bool = False  # True: the earliest occurrence (TGI), False: the latest

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {self.min_n}..{self.max_n}")


class NgramProposer:
    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self._tokens: list[int] = []
        self._continuation: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it

    def extend(self, tokens: Sequence[int]) -> None:
        seq, index, config = self._tokens, self._continuation, self.config
        for token in tokens:
            end = len(seq)  # the n-grams ending just before this token now have a continuation
            for n in range(config.min_n, min(config.max_n, end) + 1):
                gram = tuple(seq[end - n : end])
                if config.first_match:
                    index.setdefault(gram, end)
                else:
                    index[gram] = end
            seq.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        seq, config = self._tokens, self.config
        if max_tokens <= 0:
            return []
        for n in range(min(config.max_n, len(seq)), config.min_n - 1, -1):
            start = self._continuation.get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return seq[start : start + max_tokens]
        return []
