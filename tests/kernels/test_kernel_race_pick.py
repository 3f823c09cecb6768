"""tgi_compat/kernels/sampling/race_pick.py against its torch definition, under the interpreter: the hash noise bit
for bit (a row of equal scores picks the noise's own argmax), greedy rows beside sampling ones, masked ids never
chosen, and a row's choice the same alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.sampling.greedy_pick import CHUNK
from tgi_compat.kernels.sampling.race_pick import gumbel_keys, gumbel_noise_of_keys, race_pick, race_pick_ref


def _keys(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    return gumbel_keys(seeds, torch.randint(0, 500, (rows,), generator=g))


def _check(scores: torch.Tensor, keys: torch.Tensor, sampling: torch.Tensor) -> torch.Tensor:
    ids, packed = race_pick(scores, keys, sampling)
    ref_ids, ref_packed = race_pick_ref(scores, keys, sampling)
    assert ids.tolist() == ref_ids.tolist()
    assert packed[0].tolist() == ref_ids.double().tolist()
    torch.testing.assert_close(packed[1], ref_packed[1], rtol=0, atol=2e-5)
    return ids


@pytest.mark.parametrize("vocab", [70, CHUNK, CHUNK + 1, 3 * CHUNK + 17], ids=["tiny", "one-chunk", "ragged", "four"])
def test_matches_torch_with_greedy_and_sampling_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    scores = torch.randn(6, vocab, generator=g) * 3
    _check(scores, _keys(6, vocab), torch.tensor([True, False, True, True, False, True]))


def test_equal_scores_pick_the_noise_argmax_bit_for_bit():
    """With every score equal, the race is the noise's argmax: any bit of the hash or the uniform's rounding that
    differed from the torch noise would move it."""
    vocab, keys = 3 * CHUNK + 5, _keys(8, 1)
    ids = _check(torch.zeros(8, vocab), keys, torch.ones(8, dtype=torch.bool))
    assert ids.tolist() == gumbel_noise_of_keys(keys, vocab).argmax(-1).tolist()
    assert len(set(ids.tolist())) > 1  # (the rows' keys differ)


def test_masked_ids_are_never_chosen_and_a_row_alone_picks_as_in_a_batch():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(5, 2 * CHUNK + 10, generator=g)
    scores[:, ::2] = float("-inf")
    scores[4, :-1] = float("-inf")  # one id left, the last (odd)
    keys, sampling = _keys(5, 3), torch.ones(5, dtype=torch.bool)
    ids = _check(scores, keys, sampling)
    assert all(i % 2 == 1 for i in ids[:4].tolist()) and ids[4].item() == scores.shape[1] - 1
    for row in range(5):
        alone, _ = race_pick(scores[row : row + 1], keys[row : row + 1], sampling[row : row + 1])
        assert alone.item() == ids[row].item()


PROBE = r"""
import json, torch
from benchmarks.compile_only import compiled_ptx, install_compile_only_driver
install_compile_only_driver()
from tgi_compat.kernels.sampling import race_pick as rp
scores, keys, sampling = torch.zeros(64, 128256), torch.zeros(64, dtype=torch.int64), torch.ones(64, dtype=torch.bool)
partial, ids, packed = torch.zeros(5, 64, 63), torch.zeros(64, dtype=torch.int64), torch.zeros(2, 64, dtype=torch.float64)
launches = {  # (the first launch stops each call)
    rp._race_chunk_kernel: lambda: rp.race_pick(scores, keys, sampling),
    rp._race_merge_kernel: lambda: rp._race_merge_kernel[(64,)](partial, ids, packed, 128256, 64, 63, CHUNKS=64),
}
found = {}
for kernel, launch in launches.items():
    ptx = compiled_ptx(kernel, launch)
    found[kernel.fn.__name__] = dict(ptx=len(ptx) > 0, uint32_multiply="mul.lo.s32" in ptx or "mul.lo.u32" in ptx)
print(json.dumps(found))
"""


def test_race_kernels_compile_for_sm90():
    """Both kernels compile for sm_90 at Llama-3's vocabulary, the hash's products as 32-bit multiplies (wrapping
    as the torch definition's masked int64 ones)."""
    from benchmarks.compile_only import run_probe

    found = run_probe(PROBE)
    assert found["_race_chunk_kernel"] == dict(ptx=True, uint32_multiply=True), found
    assert found["_race_merge_kernel"]["ptx"], found


def test_the_samplers_gpu_path_chooses_a_rows_token_whatever_else_its_batch_asks():
    """The sampler with the kernel (as on a GPU, interpreted here): a seeded row's token is the same alone, beside a
    greedy row, and beside a row that wants top-n alternatives (which takes log_softmax for its alternatives but
    not for the choice)."""
    import dataclasses

    from tgi_compat.router.request import GenerateRequest, Request, SamplingParams
    from tgi_compat.router.sampling.batch import SamplingBatch
    from tgi_compat.router.sampling.sampler import Sampler

    vocab = CHUNK + 300
    sampler, calls = Sampler(vocab, "cpu"), []

    def counted(*args):
        calls.append(args[0].shape[0])
        return race_pick(*args)

    sampler.kernels = dataclasses.replace(sampler.kernels, race_pick=counted)

    def request(seed: int, **params) -> Request:
        return Request(GenerateRequest("r", [1, 2, 3], SamplingParams(**params)), arrival=0, seed=seed)

    seeded = [request(s, do_sample=True, temperature=0.7) for s in range(6)]
    others = {
        "alone": [],
        "greedy": [request(0)],
        "top-n": [request(9, top_n_tokens=3)],
    }
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(seeded) + 1, vocab, generator=g) * 2
    chosen = {}
    for name, extra in others.items():
        requests = seeded + extra
        batch = SamplingBatch.build(requests, vocab, torch.device("cpu"))
        out = sampler(logits[: len(requests)].clone(), batch)
        chosen[name] = out.token_ids[: len(seeded)].tolist()
    assert calls == [6, 7, 7]  # every batch chose through the kernel, the top-n one too
    assert chosen["alone"] == chosen["greedy"] == chosen["top-n"]
    assert len(set(chosen["alone"])) > 1
