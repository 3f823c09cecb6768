"""tgi_compat/kernels/sampling/grammar_apply.py and its torch reference against xgrammar's CPU apply, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.sampling.grammar_apply import grammar_apply, grammar_apply_ref

xgrammar = pytest.importorskip("xgrammar")


def _random_bitmask(rows: int, num_words: int, g: torch.Generator) -> torch.Tensor:
    bitmask = torch.randint(-(2**31), 2**31, (rows, num_words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = 0  # nothing allowed
    bitmask[1] = -1  # everything allowed
    bitmask[2, :] = 0
    bitmask[2, -1] = -(2**31)  # only the last bit of the last word: beyond the vocabulary when it is ragged
    return bitmask


@pytest.mark.parametrize(
    ("vocab", "num_words"),
    [(4096, 128), (5000, 157), (5000, 200), (70, 3)],
    ids=["aligned", "ragged", "wider-bitmask", "tiny"],
)
@pytest.mark.parametrize("indexed", [False, True], ids=["all-rows", "row-index"])
def test_matches_xgrammar(vocab, num_words, indexed):
    g = torch.Generator().manual_seed(vocab + num_words)
    num_rows, sampled = 5, [4, 0, 2, 6, 3]  # the scores rows of the bitmask rows when indexed (7 rows, 2 unconstrained)
    scores = torch.randn(7 if indexed else num_rows, vocab, generator=g)
    scores[:, ::7] = float("-inf")  # already forbidden by a penalty
    bitmask = _random_bitmask(num_rows, num_words, g)
    row_index = torch.tensor(sampled, dtype=torch.int32) if indexed else None

    expected = scores.clone()
    # xgrammar reads bitmask row b for scores row b: spread the compact rows out to their scores rows
    spread = torch.zeros(scores.shape[0], num_words, dtype=torch.int32)
    spread[sampled if indexed else slice(None)] = bitmask
    xgrammar.apply_token_bitmask_inplace(
        expected, spread, vocab_size=vocab, indices=sampled if indexed else None, backend="cpu"
    )

    torch.testing.assert_close(grammar_apply_ref(scores.clone(), bitmask, row_index), expected)
    torch.testing.assert_close(grammar_apply(scores.clone(), bitmask, row_index), expected)
    if indexed:  # the unconstrained rows are untouched
        torch.testing.assert_close(grammar_apply(scores.clone(), bitmask, row_index)[[1, 5]], scores[[1, 5]])


def test_a_bitmask_narrower_than_the_vocabulary_is_refused():
    with pytest.raises(AssertionError, match="cover"):
        grammar_apply(torch.zeros(1, 65), torch.zeros(1, 2, dtype=torch.int32), None)
