"""Draft proposers without a draft model (tgi_compat/router/speculative): n-gram lookup and suffix tries."""

from __future__ import annotations

import random

import pytest

from tgi_compat.router.speculative.ngram import NgramConfig, NgramProposer
from tgi_compat.router.speculative.suffix import SuffixConfig, SuffixCorpus, SuffixProposer
from tgi_compat.router.speculative.suffix_trie import SuffixTrie


def ngram_reference(seq: list[int], config: NgramConfig, k: int) -> list[int]:
    """A whole-sequence scan: the longest suffix n-gram seen earlier, at its latest (or first) occurrence."""
    for n in range(min(config.max_n, len(seq)), config.min_n - 1, -1):
        suffix = seq[len(seq) - n :]
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == suffix]
        if starts:
            start = (starts[0] if config.first_match else starts[-1]) + n
            return seq[start : start + k]
    return []


@pytest.mark.parametrize("config", [NgramConfig(1, 3), NgramConfig(2, 4), NgramConfig(1, 1, first_match=True)])
def test_ngram_matches_a_full_scan_at_every_length(config):
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(300)]
    proposer = NgramProposer(config)
    proposer.extend(seq[:5])
    for end in range(5, len(seq)):
        assert proposer.propose(4) == ngram_reference(seq[:end], config, 4), end
        proposer.extend(seq[end : end + 1])


def test_ngram_prefers_the_longest_match():
    proposer = NgramProposer(NgramConfig(1, 3))
    proposer.extend([7, 1, 2, 3, 9, 9, 2, 3, 5, 5, 1, 2, 3])  # "2 3" -> 5 most recently, "1 2 3" -> 9
    assert proposer.propose(2) == [9, 9]
    assert NgramProposer(NgramConfig(4, 4)).propose(3) == []


def test_ngram_without_a_match_proposes_nothing():
    proposer = NgramProposer(NgramConfig(2, 3))
    proposer.extend([1, 2, 3, 4])
    assert proposer.propose(5) == []
    assert proposer.propose(0) == []
    with pytest.raises(ValueError):
        NgramConfig(3, 2)


def test_suffix_drafts_a_repeated_span():
    proposer = SuffixProposer(SuffixConfig(max_depth=16))
    span = [10, 11, 12, 13, 14, 15, 16]
    proposer.extend([1, *span, 2, 3, 10, 11])
    assert proposer.propose(4) == [12, 13, 14, 15]
    assert proposer.propose(20) == [12, 13, 14, 15, 16, 2, 3, 10, 11][: 16 - 2]  # room left under the depth


def test_suffix_stops_where_the_continuation_is_unlikely():
    proposer = SuffixProposer(SuffixConfig(max_depth=8, min_token_probability=0.5))
    proposer.extend([5, 1, 9, 5, 2, 9, 5, 3, 9, 5])  # "9 5" was followed by 2 and 3 once each (p = 1/3)
    assert proposer.propose(3) == []
    proposer = SuffixProposer(SuffixConfig(max_depth=8, min_token_probability=0.2))
    proposer.extend([5, 1, 9, 5, 2, 9, 5, 3, 9, 5])
    assert proposer.propose(3) == [2, 9, 5]  # the first of the tied continuations, then certain


def test_suffix_corpus_shares_outputs_and_forgets_the_oldest():
    config = SuffixConfig(max_depth=12, corpus_outputs=2)
    corpus = SuffixCorpus(config)
    corpus.add([40, 41, 42, 43, 44])
    proposer = SuffixProposer(config, corpus)
    proposer.extend([7, 8, 40, 41])  # its own tokens never continue 41: the corpus does
    assert proposer.propose(3) == [42, 43, 44]
    corpus.add([50, 51])
    corpus.add([60, 61])  # evicts the first output
    assert proposer.propose(3) == []
    corpus.add([70])
    corpus.add([71])
    assert set(corpus.trie.root.children) == {70, 71}  # every node of the evicted outputs is gone


def test_suffix_trie_counts_every_suffix_up_to_its_depth():
    rng = random.Random(1)
    seq = [rng.randrange(4) for _ in range(200)]
    trie = SuffixTrie(max_depth=5)
    open_nodes = trie.open_nodes()
    for token in seq:
        open_nodes = trie.append(open_nodes, token)
    for length in range(1, 6):
        for start in range(0, len(seq) - length + 1, 17):
            path = seq[start : start + length]
            node = trie.root
            for token in path:
                node = node.children[token]
            occurrences = sum(seq[i : i + length] == path for i in range(len(seq) - length + 1))
            assert node.count == occurrences
            best = max(node.children.values(), key=lambda c: c.count, default=None)
            assert (node.best is None) == (best is None)
            assert best is None or node.best[1].count == best.count
    trie.remove(seq)
    assert not trie.root.children
