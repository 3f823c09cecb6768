"""SamplingBatchCache: a carried-forward batch must equal one built from scratch, and any change of
the sampled requests (join, finish, reorder, preemption, a failed step) must rebuild it."""

from __future__ import annotations

import pytest
import torch
from router_fakes import drain, hash_engine

import tgi_compat.router.sampling.batch_cache as sampling_cache
from tgi_compat.router.request import GenerateRequest, Request, SamplingParams
from tgi_compat.router.sampling.batch import SamplingBatch
from tgi_compat.router.sampling.batch_cache import SamplingBatchCache
from tgi_compat.router.sampling.sampler import Sampler

VOCAB = 50
CPU = torch.device("cpu")


def make(request_id: str, prompt_len: int, seed: int, **sampling) -> Request:
    prompt = [(seed * 7 + k * 3) % VOCAB for k in range(prompt_len)]
    return Request(GenerateRequest(request_id, prompt, SamplingParams(**sampling)), arrival=0, seed=seed)


def mixed_requests() -> list[Request]:
    return [
        make("greedy", 3, 1),
        make("penalised", 5, 2, do_sample=True, repetition_penalty=1.3, frequency_penalty=0.4),
        make("top", 2, 3, temperature=0.7, top_k=5, top_p=0.9, top_n_tokens=2),
        make("watermark", 4, 4, do_sample=True, watermark=True, typical_p=0.8),
    ]


def assert_same_choices(carried: SamplingBatch, fresh: SamplingBatch, logits: torch.Tensor) -> None:
    sampler = Sampler(VOCAB, CPU)
    a, b = sampler(logits.clone(), carried), sampler(logits.clone(), fresh)
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(carried.steps, fresh.steps)
    assert carried.watermark_prev_ids == fresh.watermark_prev_ids
    width = fresh.context_ids.shape[1]  # the carried history may have spare padded columns
    assert torch.equal(carried.context_ids[:, :width], fresh.context_ids)
    assert bool((carried.context_ids[:, width:] == VOCAB).all())
    assert torch.equal(carried.context_lens, fresh.context_lens)


def step(cache: SamplingBatchCache, requests: list[Request], logits: torch.Tensor) -> SamplingBatch:
    """One engine step: get the batch, sample, record, append each request's token."""
    batch = cache.get(requests)
    out = Sampler(VOCAB, CPU)(logits.clone(), batch)
    cache.sampled(out.token_ids)
    for request, token in zip(requests, out.to_host()):
        request.output_ids.append(token.token_id)
    return batch


@pytest.mark.parametrize("headroom", [1, 3, 64], ids=["grows-each-step", "grows-sometimes", "no-growth"])
def test_a_carried_batch_equals_a_fresh_one_however_the_history_grows(monkeypatch, headroom):
    monkeypatch.setattr(sampling_cache, "CONTEXT_HEADROOM", headroom)
    cache, requests = SamplingBatchCache(VOCAB, CPU), mixed_requests()
    generator = torch.Generator().manual_seed(0)
    for _ in range(9):
        step(cache, requests, torch.randn(len(requests), VOCAB, generator=generator))
    logits = torch.randn(len(requests), VOCAB, generator=generator)
    assert_same_choices(cache.get(requests), SamplingBatch.build(requests, VOCAB, CPU), logits)
    assert cache.num_builds == 1


def test_every_carried_step_matches_a_fresh_build():
    cache, requests = SamplingBatchCache(VOCAB, CPU), mixed_requests()
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        logits = torch.randn(len(requests), VOCAB, generator=generator)
        fresh = SamplingBatch.build(requests, VOCAB, CPU)
        carried = cache.get(requests)
        assert_same_choices(carried, fresh, logits)
        history = [[t for t in row if t != VOCAB] for row in carried.context_ids.tolist()]
        assert history == [r.params.prompt_ids + r.output_ids for r in requests]  # every token, in order
        out = Sampler(VOCAB, CPU)(logits.clone(), carried)
        cache.sampled(out.token_ids)
        for request, token in zip(requests, out.to_host()):
            request.output_ids.append(token.token_id)
    assert cache.num_builds == 1


def test_any_change_in_the_sampled_requests_rebuilds():
    cache, requests = SamplingBatchCache(VOCAB, CPU), mixed_requests()
    logits = torch.zeros(len(requests), VOCAB)
    step(cache, requests, logits)
    step(cache, requests, logits)
    assert cache.num_builds == 1
    step(cache, requests[:3], logits[:3])  # one finished
    assert cache.num_builds == 2
    step(cache, requests[:3] + [make("new", 2, 9, repetition_penalty=1.2)], logits)  # one joined
    assert cache.num_builds == 3
    step(cache, requests[::-1], logits)  # same requests, other rows
    assert cache.num_builds == 4


def test_a_step_whose_tokens_were_not_appended_rebuilds():
    cache, requests = SamplingBatchCache(VOCAB, CPU), mixed_requests()
    logits = torch.zeros(len(requests), VOCAB)
    step(cache, requests, logits)
    batch = cache.get(requests)  # sampled, then the step failed: nothing appended
    cache.sampled(Sampler(VOCAB, CPU)(logits.clone(), batch).token_ids)
    assert_same_choices(cache.get(requests), SamplingBatch.build(requests, VOCAB, CPU), logits)
    assert cache.num_builds == 2
    cache.get(requests)  # sampled() never called (the sampler raised): rebuilt too
    assert cache.num_builds == 3


def test_a_request_appended_to_twice_rebuilds():
    cache, requests = SamplingBatchCache(VOCAB, CPU), mixed_requests()
    logits = torch.zeros(len(requests), VOCAB)
    step(cache, requests, logits)
    requests[1].output_ids.append(7)  # e.g. a one-by-one retry appended outside this batch
    assert_same_choices(cache.get(requests), SamplingBatch.build(requests, VOCAB, CPU), logits)
    assert cache.num_builds == 2


def sampling_prompts(n: int) -> list[list[int]]:
    return [[(5 * i + 3 * k + 1) % 60 + 3 for k in range(6 + i % 4)] for i in range(n)]


def sampled_params(i: int) -> SamplingParams:
    return SamplingParams(
        do_sample=i % 3 != 0,
        temperature=0.8,
        top_k=8 if i % 2 else 0,
        seed=100 + i,
        repetition_penalty=1.5 if i % 2 else 1.0,
        frequency_penalty=0.5 if i % 3 == 1 else 0.0,
    )


def run_alone(i: int, prompt: list[int]) -> list[int]:
    engine = hash_engine()
    engine.add_request(GenerateRequest("solo", prompt, sampled_params(i), max_new_tokens=10))
    return [t for e in drain(engine)["solo"] for t in e.token_ids]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(),
        dict(max_prefill=5),
        dict(max_running=3),
        dict(num_kv_slots=60, router_token_ratio=1.0, router_max_new_token_len=1),
    ],
    ids=["batched", "chunked", "queued", "preempted"],
)
def test_seeded_penalised_sampling_in_a_changing_batch_equals_each_request_alone(engine_kwargs):
    engine = hash_engine(**engine_kwargs)
    batch = sampling_prompts(8)
    for i, prompt in enumerate(batch):
        engine.add_request(GenerateRequest(f"r{i}", prompt, sampled_params(i), max_new_tokens=10))
    engine.abort("r5")  # aborted before it ever runs
    events = drain(engine)
    cache = engine.selector.batches
    for i, prompt in enumerate(batch):
        if i != 5:
            assert [t for e in events[f"r{i}"] for t in e.token_ids] == run_alone(i, prompt), f"r{i}"
    assert events["r5"][-1].finish_reason == "abort"
    if not engine_kwargs:  # one composition for most steps: the carried batch was really used
        assert cache.num_builds < 5
