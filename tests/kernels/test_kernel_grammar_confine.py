"""tgi_compat/kernels/sampling/grammar_confine.py against its torch reference (the engine's CPU path), under the interpreter."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.sampling.grammar_confine import grammar_confine, grammar_confine_ref


def _case(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    num_words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, num_words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = 0
    bitmask[0, 3] = -(2**31)  # only bit 31 of word 3: token 127
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 5  # only token 5
    scores = torch.randn(6, vocab, generator=g)
    allowed = ((bitmask[:, :, None].to(torch.int64) >> torch.arange(32)) & 1).bool().view(6, -1)[:, :vocab]
    scores[~allowed] = float("-inf")
    scores[0] = float("-inf")  # nothing allowed kept a score
    scores[1, :] = float("nan")  # an inf temperature: -inf / inf
    scores[2, 7] = float("inf")  # a zero temperature
    scores[3, ::3] = float("nan")
    return scores, bitmask


@pytest.mark.parametrize("vocab", [200, 5000])
@pytest.mark.parametrize("subset", [False, True])
def test_matches_the_reference(vocab, subset):
    scores, bitmask = _case(vocab, seed=vocab)
    row_index = torch.tensor([0, 1, 3, 5], dtype=torch.int32) if subset else None
    compact = bitmask if row_index is None else bitmask[row_index.long()]  # row r for scores row row_index[r]
    expected = grammar_confine_ref(scores.clone(), compact, row_index)
    got = grammar_confine(scores.clone(), compact, row_index)
    torch.testing.assert_close(got, expected, equal_nan=False)
    assert got[0].argmax() == 127 and got[1].argmax() == 5
    assert not got.isnan().any() if not subset else not got[[0, 1, 3, 5]].isnan().any()
    if not subset:
        assert got[2, 7] == torch.finfo(torch.float32).max
