"""The KV cache is transparent: chunked prefill, decode steps and mixed batches (with slots
scattered anywhere in the pool) give the logits of one full forward over each sequence."""

from __future__ import annotations

import pytest
import torch

from tests.modeling.helpers import full_logits, max_rel_error, run_step, tiny_runner
from tgi_compat.modeling.forward_batch import ForwardMode, build_forward_batch

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runner():
    _, runner = tiny_runner()  # GQA: 4 query heads over 2 KV heads
    return runner


def sequence(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def scattered_slots(count: int, seed: int, pool: int = 1024) -> list[int]:
    return torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def reference(runner, ids: list[int]) -> torch.Tensor:
    # Rows/slots far from the ones the tests use, so the reference never aliases their cache.
    return full_logits(runner, ids, row=7, first_slot=1024 - len(ids))


def test_chunked_prefill_then_decode_matches_full_forward(runner):
    ids, slots = sequence(40, seed=1), scattered_slots(40, seed=1)
    want = reference(runner, ids)
    got, start = [], 0
    for chunk in (11, 13, 6):  # prefill in three chunks over the growing cached prefix
        got += run_step(runner, [(0, ids[start : start + chunk], start, slots[start : start + chunk])])
        start += chunk
    while start < len(ids):  # then one token per step
        got += run_step(runner, [(0, ids[start : start + 1], start, slots[start : start + 1])])
        start += 1
    assert max_rel_error(torch.cat(got), want) <= TOLERANCE


def test_mixed_batch_decode_beside_prefills(runner):
    a, b, c = sequence(25, seed=2), sequence(30, seed=3), sequence(18, seed=4)
    slots = scattered_slots(73, seed=5)
    slots_a, slots_b, slots_c = slots[:25], slots[25:55], slots[55:]
    want_a, want_b, want_c = (reference(runner, s) for s in (a, b, c))

    first = run_step(runner, [(1, a[:24], 0, slots_a[:24]), (2, b[:10], 0, slots_b[:10])])
    # a decodes its last token while b prefills its next chunk and c starts from scratch.
    batch = build_forward_batch(
        a[24:] + b[10:30] + c, [1, 2, 3], [1, 20, 18], [25, 30, 18], slots_a[24:] + slots_b[10:] + slots_c, [0]
    )
    assert batch.mode == ForwardMode.MIXED
    second = run_step(runner, [(1, a[24:], 24, slots_a[24:]), (2, b[10:], 10, slots_b[10:]), (3, c, 0, slots_c)])

    assert max_rel_error(torch.cat((first[0], second[0])), want_a) <= TOLERANCE
    assert max_rel_error(torch.cat((first[1], second[1])), want_b) <= TOLERANCE
    assert max_rel_error(second[2], want_c) <= TOLERANCE


def test_decode_batch_of_different_lengths(runner):
    seqs = [sequence(n, seed=10 + n) for n in (5, 17, 33)]
    slots = scattered_slots(sum(len(s) for s in seqs), seed=6)
    wants = [reference(runner, s) for s in seqs]
    offsets = [0, 5, 22]
    prefill = run_step(
        runner, [(row, s[:-1], 0, slots[o : o + len(s) - 1]) for row, (s, o) in enumerate(zip(seqs, offsets))]
    )
    decode = run_step(
        runner, [(row, s[-1:], len(s) - 1, [slots[o + len(s) - 1]]) for row, (s, o) in enumerate(zip(seqs, offsets))]
    )
    for want, first, last in zip(wants, prefill, decode):
        assert max_rel_error(torch.cat((first, last)), want) <= TOLERANCE


def test_logits_only_for_requested_rows(runner):
    ids = sequence(12, seed=7)
    batch = build_forward_batch(ids, [4], [12], [12], list(range(12)), [3, 11])
    logits = runner.forward(batch)
    assert logits.shape == (2, runner.vocab_size) and logits.dtype == torch.float32
    full = full_logits(runner, ids, row=4)
    assert max_rel_error(logits, full[[3, 11]]) <= TOLERANCE
