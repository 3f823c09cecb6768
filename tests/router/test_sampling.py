"""Batched token selection: masks, penalties, watermark, seeds and top-n, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tgi_compat.router.request import GenerateRequest, Request, SamplingParams
from tgi_compat.router.sampling.batch import SamplingBatch
from tgi_compat.router.sampling.sampler import (
    WATERMARK_DELTA,
    Sampler,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
    gumbel_noise,
    watermark_green_list,
)

VOCAB = 8


def request(prompt=(1, 2, 3), output=(), seed=None, **sampling) -> Request:
    r = Request(GenerateRequest("r", list(prompt), SamplingParams(**sampling)), arrival=0, seed=seed)
    r.output_ids = list(output)
    return r


def sample(logits, requests, vocab=VOCAB):
    batch = SamplingBatch.build(requests, vocab, torch.device("cpu"))
    return Sampler(vocab, "cpu")(logits.clone(), batch).to_host()


def processed(logits, requests):
    batch = SamplingBatch.build(requests, logits.shape[-1], torch.device("cpu"))
    return Sampler(logits.shape[-1], "cpu").process(logits.clone(), batch)


def test_greedy_is_argmax_with_the_logprob_of_the_chosen_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 1]])
    out = sample(logits, [request(), request()])
    assert [t.token_id for t in out] == [1, 0]
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


@pytest.mark.parametrize(
    "params",
    [{}, {"repetition_penalty": 1.3}, {"do_sample": True, "seed": 5}, {"top_n_tokens": 2}],
    ids=["greedy", "greedy-with-penalty", "sampled", "top-n"],
)
def test_bfloat16_logits_give_the_choices_of_their_float32_values(params):
    """The model hands over logits in its dtype; every path reads them as their exact float32 values."""
    torch.manual_seed(1)
    logits = (torch.randn(3, 300) * 3).to(torch.bfloat16)
    seed = params.pop("seed", None)
    requests = [request(output=[4, 9], seed=seed, **params) for _ in range(3)]
    wide, narrow = sample(logits.float(), requests, 300), sample(logits, requests, 300)
    assert [(t.token_id, t.logprob, t.top_tokens) for t in narrow] == [
        (t.token_id, t.logprob, t.top_tokens) for t in wide
    ]


def test_top_k_keeps_ties_and_leaves_disabled_rows_alone():
    scores = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0], [1.0, 3.0, 2.0, 2.0, 0.0]])
    out = apply_top_k(scores, torch.tensor([2, 0]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, False, True]
    assert torch.equal(out[1], scores[1])


def test_top_p_drops_the_low_tail_but_keeps_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]])
    # row 0: top_p 0.75 -> keep 0.5, 0.3 (ascending cumsum 0.05, 0.2 <= 0.25 removed, 0.5 kept)
    # row 1: disabled; row 2: top_p 0.01 -> only the top token
    out = apply_top_p(probs.log(), torch.tensor([0.75, 1.0, 0.01]))
    assert torch.isinf(out).tolist() == [
        [False, False, True, True],
        [False, False, False, False],
        [False, True, True, True],
    ]


def test_typical_p_keeps_tokens_whose_surprise_is_near_the_entropy():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logp = probs.log()
    entropy = -(probs * logp).sum()
    distance = (-logp[0] - entropy).abs()  # order by distance, keep until mass >= typical_p
    order = distance.argsort()
    mass, kept = 0.0, []
    for index in order.tolist():
        kept.append(index)
        mass += float(probs[0, index])
        if mass >= 0.5:
            break
    out = apply_typical_p(logp, torch.tensor([0.5]))
    assert sorted(torch.nonzero(~torch.isinf(out[0])).flatten().tolist()) == sorted(kept)


def test_repetition_and_frequency_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, 1.0, 0, 0, 0]])
    # context: prompt (1, 2) + generated (2, 4): ids 1, 2, 4 present; 2 twice; L = 4
    r = request(prompt=(1, 2), output=(2, 4), repetition_penalty=2.0, frequency_penalty=0.5)
    out = processed(logits, [r])[0]
    expected = logits[0].clone()
    expected[1] = -1.0 * 2.0 - 0.5 * 1 / 4
    expected[2] = 3.0 / 2.0 - 0.5 * 2 / 4
    expected[4] = 1.0 / 2.0 - 0.5 * 1 / 4
    assert torch.allclose(out, expected)


def test_penalties_apply_per_row_only():
    logits = torch.zeros(2, VOCAB)
    logits[:, 1] = 4.0
    out = processed(logits, [request(prompt=(1,), repetition_penalty=4.0), request(prompt=(1,))])
    assert out[0, 1] == 1.0 and out[1, 1] == 4.0


def test_watermark_adds_delta_to_the_green_list_of_the_previous_token():
    vocab = 64
    logits = torch.zeros(2, vocab)
    out = processed(logits, [request(prompt=(5, 7), watermark=True), request(prompt=(5, 7))])
    green = watermark_green_list(7, vocab)
    assert len(green) == 32
    expected = torch.zeros(vocab)
    expected[green] = WATERMARK_DELTA
    assert torch.equal(out[0], expected) and torch.equal(out[1], torch.zeros(vocab))
    generator = torch.Generator().manual_seed(15485863 * 7)
    assert torch.equal(green, torch.randperm(vocab, generator=generator)[:32])
    assert not torch.equal(watermark_green_list(8, vocab), green)


def test_temperature_scales_the_reported_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0, 0, 0, 0, 0, 0]])
    out = sample(logits, [request(temperature=0.5, seed=3)])[0]
    expected = torch.log_softmax(logits[0] / 0.5, -1)[out.token_id]
    assert out.logprob == pytest.approx(float(expected))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    alone = [
        sample(logits, [request(seed=42, do_sample=True, output=[0] * step)], 1000)[0].token_id for step in range(20)
    ]
    other = request(seed=7, do_sample=True)
    batched = [
        sample(logits.repeat(2, 1), [other, request(seed=42, do_sample=True, output=[0] * step)], 1000)[1].token_id
        for step in range(20)
    ]
    assert alone == batched
    assert len(set(alone)) > 5  # it really samples
    different_seed = [
        sample(logits, [request(seed=43, do_sample=True, output=[0] * s)], 1000)[0].token_id for s in range(20)
    ]
    assert different_seed != alone


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)] + [-1e9] * 5])
    draws = [sample(logits, [request(seed=s, do_sample=True)])[0].token_id for s in range(600)]
    frequencies = [draws.count(i) / len(draws) for i in range(3)]
    assert frequencies == pytest.approx([0.7, 0.2, 0.1], abs=0.06)


def test_the_noise_never_lets_an_impossible_token_win():
    # Seed 10's noise at step 0 peaks on token 5013 of a 49,152-token vocabulary: its uniform draw was the
    # largest, which float32 rounded to 1.0, so the noise was +inf and the token won from a -inf score
    # (a grammar's mask) or from any finite one (issue 15's " relativeadmin").
    # 50 seeds at a time: the same values, without [2000, 49152] int64 temporaries (3x faster)
    chunks = torch.arange(2000).split(50)
    assert all(bool(torch.isfinite(gumbel_noise(seeds, torch.zeros_like(seeds), 49152)).all()) for seeds in chunks)
    logits = torch.zeros(1, 49152)
    logits[0, 5013] = float("-inf")
    logits[0, 7] = 5.0  # every other token is a possible draw
    token = sample(logits, [request(seed=10, do_sample=True)], 49152)[0]
    assert token.token_id != 5013 and math.isfinite(token.logprob)


def test_top_n_includes_ties_at_the_nth_value():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0, 0, 0], [3.0, 2.0, 1.0, 0, 0, 0, 0, 0]])
    out = sample(logits, [request(top_n_tokens=2), request()])
    assert [t.token_id for t in out[0].top_tokens] == [0, 1, 2, 3]
    logprobs = torch.log_softmax(logits[0], -1)
    assert out[0].top_tokens[1].logprob == pytest.approx(float(logprobs[1]))
    assert out[1].top_tokens == []


def test_top_n_ties_beyond_the_prefetched_columns():
    logits = torch.zeros(1, 40)
    logits[0, 0] = 1.0
    out = sample(logits, [request(top_n_tokens=2)], vocab=40)
    assert len(out[0].top_tokens) == 40  # 39 tied at the 2nd value: all reported (capped at vocab)
    assert out[0].top_tokens[0].token_id == 0


def test_top_n_never_counts_masked_tokens_as_ties():
    """top_k=1 leaves one finite logprob: top_n_tokens=2 reports that one, never the -inf rest."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0, 0, 0, 0, 0]])
    out = sample(logits, [request(top_k=1, top_n_tokens=2, do_sample=True, seed=1)])
    assert [t.token_id for t in out[0].top_tokens] == [0]
    assert all(math.isfinite(t.logprob) for t in out[0].top_tokens)


def test_logit_bias_shifts_raw_scores_per_row_before_the_other_processors():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [0.0, 3.0, 1.0, 0, 0, 0, 0, 0]])
    biased = request(logit_bias=((2, 5.0), (1, -1.0)))
    scores = processed(logits, [biased, request()])
    assert scores[0].tolist() == [0.0, 2.0, 6.0, 0, 0, 0, 0, 0]
    assert scores[1].tolist() == logits[1].tolist()  # rows without a bias are untouched
    out = sample(logits, [biased, request()])
    assert [t.token_id for t in out] == [2, 1]
    assert out[0].logprob == pytest.approx(
        float(torch.log_softmax(scores[0], -1)[2]), abs=1e-6
    )  # processed distribution
    # with temperature the bias is applied first, then scaled
    hot = processed(logits, [request(logit_bias=((2, 5.0),), temperature=2.0)])
    assert hot[0, 2].item() == pytest.approx(3.0)


def test_logit_bias_outside_the_vocabulary_is_rejected_before_admission():
    from tgi_compat.router.client_api import EngineInfo, Refusal, RequestRejectedError
    from tgi_compat.router.validation import validate_request

    info = EngineInfo("m", "LlamaForCausalLM", "float32", "cpu", VOCAB, 64, 64, 64, (0,))
    params = GenerateRequest("r", [1, 2], SamplingParams(logit_bias=((VOCAB, 1.0),)), max_new_tokens=2)
    with pytest.raises(RequestRejectedError) as refused:
        validate_request(params, info)
    assert (refused.value.reason, refused.value.values) == (Refusal.LOGIT_BIAS_TOKEN, (VOCAB, VOCAB))
