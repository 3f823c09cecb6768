"""Suffix decoding: drafts from a suffix trie of the request's own prompt + output, and optionally of a
bounded corpus of recent outputs shared by all requests (agentic and code-editing loops repeat
themselves across requests). Whichever trie promises more expected accepted tokens wins.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tgi_compat.router.speculative.suffix_trie import SuffixTrie, walk


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    max_depth: int = 24  # longest path in a trie: matched context + draft
    min_token_probability: float = 0.1  # stop a draft where its estimated probability falls below this
    corpus_outputs: int = 0  # recent finished outputs kept in the shared corpus; 0: none


class SuffixCorpus:
    """The shared trie of the last `config.corpus_outputs` finished outputs (the oldest leaves first)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.trie = SuffixTrie(config.max_depth)
        self._outputs: deque[list[int]] = deque()

    def add(self, output: Sequence[int]) -> None:
        if self.config.corpus_outputs <= 0 or not output:
            return
        if len(self._outputs) == self.config.corpus_outputs:
            self.trie.remove(self._outputs.popleft())
        tokens = list(output)
        open_nodes = self.trie.open_nodes()
        for token in tokens:
            open_nodes = self.trie.append(open_nodes, token)
        self._outputs.append(tokens)


class SuffixProposer:
    def __init__(self, config: SuffixConfig, corpus: SuffixCorpus | None = None) -> None:
        self.config = config
        self.corpus = corpus
        self._trie = SuffixTrie(config.max_depth)
        self._open = self._trie.open_nodes()
        self._recent: deque[int] = deque(maxlen=config.max_depth)  # the context the corpus is matched on

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._open = self._trie.append(self._open, token)
        self._recent.extend(tokens)

    def propose(self, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        max_match = max(1, self.config.max_depth - max_tokens)  # leave depth for the draft
        best: tuple[list[int], float] = ([], 0.0)
        # The own trie: the open node of each suffix length is that suffix's node; the longest with a
        # continuation (seen earlier in the sequence) is the match.
        for length in range(min(len(self._open) - 1, max_match), 0, -1):
            if self._open[length].best is not None:
                best = walk(self._open[length], max_tokens, self.config.min_token_probability)
                break
        if self.corpus is not None and (found := self.corpus.trie.find(list(self._recent), max_match)) is not None:
            shared = walk(found[0], max_tokens, self.config.min_token_probability)
            if shared[1] > best[1]:
                best = shared
        return best[0]
