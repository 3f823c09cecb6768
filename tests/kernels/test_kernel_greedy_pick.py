"""tgi_compat/kernels/sampling/greedy_pick.py against the torch computation it replaces (argmax, gather, logsumexp), under the
interpreter: the first maximum wins ties across chunks, masked tails, bf16 logits, padded row strides."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.sampling.greedy_pick import CHUNK, greedy_pick, greedy_pick_ref


def _check(logits: torch.Tensor) -> None:
    ids, packed = greedy_pick(logits)
    ref_ids, ref_packed = greedy_pick_ref(logits)
    assert ids.dtype == torch.int64 and packed.dtype == torch.float64
    assert ids.tolist() == ref_ids.tolist()
    assert packed[0].tolist() == ref_ids.double().tolist()
    torch.testing.assert_close(packed[1], ref_packed[1], rtol=0, atol=2e-5)


@pytest.mark.parametrize("vocab", [70, CHUNK, CHUNK + 1, 3 * CHUNK + 17], ids=["tiny", "one-chunk", "ragged", "four"])
def test_matches_torch(vocab):
    g = torch.Generator().manual_seed(vocab)
    _check(torch.randn(5, vocab, generator=g) * 4)


def test_ties_take_the_first_maximum_across_and_within_chunks():
    logits = torch.zeros(4, 3 * CHUNK)
    logits[0, [CHUNK + 5, 5, 2 * CHUNK]] = 7.0  # in three chunks: the first chunk's wins
    logits[1, [2 * CHUNK + 1, 2 * CHUNK + 3]] = 3.0  # within one chunk
    logits[2, -1] = 1.0  # the last id
    logits[3] = 2.5  # every id ties: id 0
    ids, packed = greedy_pick(logits)
    assert ids.tolist() == [5, 2 * CHUNK + 1, 3 * CHUNK - 1, 0]
    torch.testing.assert_close(packed[1], greedy_pick_ref(logits)[1][1], rtol=0, atol=2e-5)


def test_masked_scores_and_a_row_that_is_nearly_all_masked():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2 * CHUNK + 9, generator=g)
    logits[:, ::3] = float("-inf")  # a grammar or top-k left these out
    logits[2, :] = float("-inf")
    logits[2, CHUNK + 4] = -3.0  # one allowed id, in a chunk after one that is all -inf
    _check(logits)
    assert greedy_pick(logits)[1][1, 2].item() == 0.0  # log(1): it is certain


def test_bfloat16_logits_and_a_padded_row_stride():
    g = torch.Generator().manual_seed(2)
    wide = (torch.randn(3, CHUNK + 300, generator=g) * 3).to(torch.bfloat16)
    logits = wide[:, : CHUNK + 100]  # rows CHUNK + 300 apart
    ids, packed = greedy_pick(logits)
    ref_ids, ref_packed = greedy_pick_ref(logits)
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(packed[1], ref_packed[1], rtol=0, atol=2e-5)


def test_no_rows():
    ids, packed = greedy_pick(torch.zeros(0, 100))
    assert ids.shape == (0,) and packed.shape == (2, 0)


def _vocab_blocks(logits: torch.Tensor, ranks: int) -> list[tuple[torch.Tensor, int]]:
    """The logits as vocab-parallel ranks hold them: equal blocks padded with zero-weight ids (logit 0) past the
    vocabulary, of which only the real ids count (tgi_compat.modeling.parallel.vocab_shard)."""
    vocab = logits.shape[1]
    padded = -(-vocab // ranks)
    blocks = []
    for rank in range(ranks):
        start = min(rank * padded, vocab)
        size = min(padded, vocab - start)
        block = torch.zeros(logits.shape[0], padded, dtype=logits.dtype)
        block[:, :size] = logits[:, start : start + size]
        blocks.append((block[:, :size], start))
    return blocks


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("vocab", [5, 70, 2 * CHUNK + 9], ids=["fewer-ids-than-blocks-x2", "tiny", "ragged"])
def test_vocab_blocks_merge_to_the_whole_choice(ranks, vocab):
    from tgi_compat.kernels.sampling.greedy_pick import (
        greedy_block_partials,
        greedy_block_partials_ref,
        greedy_merge_blocks,
        greedy_merge_blocks_ref,
    )

    g = torch.Generator().manual_seed(vocab + ranks)
    logits = (torch.randn(4, vocab, generator=g) * 4).bfloat16()
    logits[1, [0, vocab - 1]] = 30.0  # a tie across the first and the last block: the first id wins
    blocks = _vocab_blocks(logits, ranks)
    by_kernel = torch.cat([greedy_block_partials(b, start, vocab) for b, start in blocks], dim=1)
    by_torch = torch.cat([greedy_block_partials_ref(b, start, vocab) for b, start in blocks], dim=1)
    assert by_kernel.dtype == torch.bfloat16 and by_kernel.shape == (4, 12 * ranks)
    assert bool((by_kernel == by_kernel.round()).all() and (by_kernel >= 0).all() and (by_kernel <= 255).all())
    decoded = [parts.to(torch.uint8).view(torch.float32) for parts in (by_kernel, by_torch)]  # [4, 3 * ranks]
    torch.testing.assert_close(decoded[0], decoded[1], rtol=1e-6, atol=0)
    ref_ids, ref_packed = greedy_pick_ref(logits)
    for ids, packed in (greedy_merge_blocks(by_kernel, vocab), greedy_merge_blocks_ref(by_torch, vocab)):
        assert ids.tolist() == ref_ids.tolist() and ids[1] == 0
        assert packed[0].tolist() == ref_ids.double().tolist()
        torch.testing.assert_close(packed[1], ref_packed[1], rtol=0, atol=2e-5)
