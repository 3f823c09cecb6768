"""GrammarBackend's per-step masks: compact rows (the constrained sampled rows only), their row index, and the
host buffer reused from step to step (on a GPU it is pinned once: pinning is slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tgi_compat.router.sampling.grammar import GrammarBackend
from tgi_compat.router.sampling.grammar_compile import CompileLimits
from tgi_compat.router.sampling.sampler import SamplingKernels

xgrammar = pytest.importorskip("xgrammar")

VOCAB = [f"t{i}" for i in range(40)]  # 40 tokens: two bitmask words
VOCAB[1], VOCAB[2], VOCAB[3] = "a", "b", "</s>"
EOS = 3


@pytest.fixture(scope="module")
def compiled():
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgrammar.GrammarCompiler(info).compile_grammar('root ::= "a" "b"*')


def matcher(compiled, tokens: list[int]):
    m = xgrammar.GrammarMatcher(compiled)
    for token in tokens:
        assert m.accept_token(token)
    return m


# What GrammarBackend reads of its compiler (these tests compile their grammars themselves).
COMPILER = SimpleNamespace(
    vocab_size=len(VOCAB), stop_token_ids=[EOS], limits=CompileLimits(timeout_s=1.0, cache_bytes=0)
)


def constrained(m) -> SimpleNamespace:
    """What GrammarBackend.mask reads of a Request."""
    return SimpleNamespace(matcher=m, grammar_terminated=False)


def allowed(row: torch.Tensor) -> set[int]:
    return {t for t in range(len(VOCAB)) if (int(row[t // 32]) >> (t % 32)) & 1}


def test_masks_are_compact_rows_with_their_row_index(compiled):
    backend = GrammarBackend(COMPILER, torch.device("cpu"))
    fresh, done, after_a = matcher(compiled, []), matcher(compiled, [1, EOS]), matcher(compiled, [1])
    requests = [constrained(m) for m in (fresh, None, done, after_a, None)]
    requests[2].grammar_terminated = True  # as GrammarBackend.advance sets it on the stop token

    mask = backend.mask(requests)
    assert [allowed(row) for row in mask.bitmask] == [{1}, {EOS}, {2, EOS}]  # a completed grammar: stop only
    assert mask.row_index.tolist() == [0, 2, 3] and mask.row_index.dtype == torch.int32

    buffer = mask.bitmask.data_ptr()
    every_row = backend.mask([constrained(m) for m in (after_a, fresh)])
    assert [allowed(row) for row in every_row.bitmask] == [{2, EOS}, {1}]
    assert every_row.row_index is None  # every sampled row is constrained: no index
    assert every_row.bitmask.data_ptr() == buffer  # the host buffer is reused, not allocated again

    assert backend.mask([constrained(None)]) is None


def test_the_scores_of_unconstrained_rows_are_left_alone(compiled):
    backend = GrammarBackend(COMPILER, torch.device("cpu"))
    requests = [constrained(m) for m in (None, matcher(compiled, [1]))]
    scores = torch.randn(2, len(VOCAB))
    masked = SamplingKernels.for_device(torch.device("cpu")).apply_grammar(scores.clone(), backend.mask(requests))
    torch.testing.assert_close(masked[0], scores[0])
    assert set(torch.isfinite(masked[1]).nonzero().flatten().tolist()) == {2, EOS}
