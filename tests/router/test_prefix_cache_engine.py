"""Prefix caching in the engine: the same tokens with the cache on as off, and the cache really hit.

The stand-in HashRunner reads a request's context only through its req_to_token row and the KV
slots, so a hit whose slots or row are wrong changes the tokens (tests/router/router_fakes.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from router_fakes import EOS, drain_events, hash_engine, make_request, result_for
from test_engine import expected_greedy, tokens_of
from test_engine_overlap import comparable, every_kind_of_request, run_engine

from tgi_compat.router.admission import AdmissionLimits
from tgi_compat.router.batching_hold import SHORT_PREFILL_HOLD_STEPS
from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.scheduler import Scheduler, SchedulerLimits
from tgi_compat.router.step import SampledToken, StepResult


def shared_prefix_prompts(n: int = 20) -> list[list[int]]:
    """Conversations on one system prompt: each prompt continues an earlier one or the system prompt."""
    system = [(7 * k) % 50 + 3 for k in range(12)]
    out = []
    for i in range(n):
        base = out[i // 2] if i >= 4 else system
        out.append(base + [(11 * i + 3 * k) % 50 + 3 for k in range(2 + i % 3)])
    return out


SCENARIOS = {
    "batched": dict(),
    "chunked": dict(max_prefill=5),  # chunks cut through cached prefixes
    "queued": dict(max_running=3),  # later requests hit earlier ones' finished tokens
    "preempted": dict(num_kv_slots=120, router_token_ratio=1.0, router_max_new_token_len=1),
}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_shared_prefixes_hit_and_give_the_models_tokens(scenario, overlap):
    engine = hash_engine(overlap_scheduling=overlap, **SCENARIOS[scenario])
    prompts = shared_prefix_prompts()
    for wave in range(2):  # the second wave finds every prompt cached
        requests = [GenerateRequest(f"{wave}-{i}", p, max_new_tokens=6) for i, p in enumerate(prompts)]
        events = drain_events(engine, requests)
        for i, prompt in enumerate(prompts):
            assert tokens_of(events[f"{wave}-{i}"]) == expected_greedy(prompt, 6), (wave, i)
    pool = engine.pool
    assert pool.num_prefix_hit_tokens > sum(map(len, prompts)) // 2
    pool.flush_prefix_cache()
    assert pool.num_free_slots == len(pool._free_slots) == pool.num_slots


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_every_kind_of_request_gives_the_same_events_with_the_cache_on_and_off(overlap):
    kwargs = SCENARIOS["preempted"]
    off = run_engine(overlap, every_kind_of_request(), prefix_caching=False, **kwargs)
    copies = [dataclasses.replace(r, request_id=f"copy-{r.request_id}") for r in every_kind_of_request()]
    on = run_engine(overlap, every_kind_of_request() + copies, prefix_caching=True, **kwargs)
    for request_id in off:  # (the copies ran alongside, sharing their prompts' KV)
        assert comparable(on[request_id]) == comparable(off[request_id]), request_id


def test_a_preempted_request_comes_back_as_a_cache_hit():
    engine = hash_engine(num_kv_slots=60, router_token_ratio=1.0, router_max_new_token_len=1)
    prompts = [[(5 * i + 3 * k) % 50 + 3 for k in range(8)] for i in range(6)]  # no two share a first token
    events = drain_events(engine, [GenerateRequest(f"r{i}", p, max_new_tokens=12) for i, p in enumerate(prompts)])
    assert engine.stats.num_preemptions > 0
    assert engine.pool.num_prefix_hit_tokens > 0  # only a preempted request can hit: nothing is shared
    for i, prompt in enumerate(prompts):
        assert tokens_of(events[f"r{i}"]) == expected_greedy(prompt, 12)


def test_a_request_hits_the_prompt_of_one_still_running():
    """n / best_of siblings and a common system prompt share KV while the first request runs."""
    engine = hash_engine()
    prompt = shared_prefix_prompts()[5]
    engine.add_request(GenerateRequest("first", prompt, max_new_tokens=8))
    engine.step()  # prefilled: its prompt is cached and locked
    assert engine.pool.prefix_cache.num_locked_tokens == len(prompt)
    engine.add_request(GenerateRequest("sibling", prompt, max_new_tokens=8))
    events = drain_events(engine, [])
    assert engine.pool.num_prefix_hit_tokens == len(prompt) - 1  # all but the last token, computed to sample
    assert tokens_of(events["sibling"]) == expected_greedy(prompt, 8)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_siblings_sent_together_compute_their_prompt_once(overlap):
    """`n` / `best_of`: the siblings wait for the first one's prefill and take its prompt KV."""
    engine = hash_engine(overlap_scheduling=overlap)
    prompt = shared_prefix_prompts()[7]
    siblings = [GenerateRequest(f"n{i}", prompt, max_new_tokens=5) for i in range(3)]
    events = drain_events(engine, siblings + [GenerateRequest("other", prompt[:-1], max_new_tokens=5)])
    assert engine.pool.num_prefix_hit_tokens >= 2 * (len(prompt) - 1)
    for i in range(3):
        assert tokens_of(events[f"n{i}"]) == expected_greedy(prompt, 5)
    assert tokens_of(events["other"]) == expected_greedy(prompt[:-1], 5)


def test_prompt_logprob_requests_compute_their_whole_prompt():
    prompts = shared_prefix_prompts(6)
    warm = hash_engine()
    drain_events(warm, [GenerateRequest(f"w{i}", p, max_new_tokens=3) for i, p in enumerate(prompts)])
    hits_before = warm.pool.num_prefix_hit_tokens
    scored = [GenerateRequest(f"s{i}", p, max_new_tokens=3, prompt_logprobs=True) for i, p in enumerate(prompts)]
    on = drain_events(warm, scored)
    assert warm.pool.num_prefix_hit_tokens == hits_before
    off = drain_events(hash_engine(prefix_caching=False), scored)
    for request_id in off:
        assert comparable(on[request_id]) == comparable(off[request_id])


def test_only_kv_written_by_a_completed_step_is_cached():
    """Overlap scheduling: a request that ends on the token of step N while step N+1 (which writes
    that token's K/V) is in flight caches prompt + the tokens before it, not that token."""
    pool = KVSlotPool(100, 4, prefix_caching=True)
    scheduler = Scheduler(pool, SchedulerLimits(64, AdmissionLimits(100, 4)), frozenset({EOS}))
    request = make_request("r", num_prompt=5, max_new=10, stop_token_ids=[77])
    scheduler.add(request)
    first = scheduler.schedule()  # positions 0..4, samples token 5
    scheduler.update(first, result_for(first))
    second = scheduler.schedule()  # position 5; samples token 6, left on the device
    scheduler.tokens_in_flight(second, [0])
    third = scheduler.schedule()  # position 6, fed the pending token
    assert request.num_computed_tokens == 7
    scheduler.update(second, StepResult(tokens=[SampledToken(77, -0.1)]))  # token 6 is a stop id
    assert request.is_finished
    assert pool.prefix_cache.num_cached_tokens == 6  # positions 0..5: token 6's K/V is still in flight
    scheduler.update(third, result_for(third))
    assert pool.is_full_free()


LONG_PREFIX = [(13 * k) % 50 + 3 for k in range(300)]  # a "system prompt" longer than MIN_SHARED_PREFILL_TOKENS


def long_prefix_prompts(n: int) -> list[list[int]]:
    return [LONG_PREFIX + [(7 * i + k) % 50 + 3 for k in range(3 + i)] for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("max_prefill", [512, 64], ids=["one-chunk", "chunked"])
def test_requests_sent_together_compute_a_shared_prefix_once(max_prefill, overlap):
    """The first request prefills the prefix; the others wait until it is published and take it."""
    engine = hash_engine(max_prefill=max_prefill, overlap_scheduling=overlap)
    prompts = long_prefix_prompts(4)
    events = drain_events(engine, [GenerateRequest(f"r{i}", p, max_new_tokens=4) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert tokens_of(events[f"r{i}"]) == expected_greedy(prompt, 4)
    assert engine.pool.num_prefix_hit_tokens == 3 * len(LONG_PREFIX)
    assert engine.stats.num_prompt_tokens == sum(map(len, prompts)) - 3 * len(LONG_PREFIX)


def test_unrelated_requests_are_not_held_behind_a_deferred_one():
    engine = hash_engine()
    first, second = long_prefix_prompts(2)
    unrelated = [50, 49, 48, 47, 46]
    for request_id, prompt in (("first", first), ("second", second), ("unrelated", unrelated)):
        engine.add_request(GenerateRequest(request_id, prompt, max_new_tokens=4))
    engine.step()  # first: its whole prompt; second: deferred; unrelated: admitted behind it
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"first", "unrelated"}
    events = drain_events(engine, [])
    assert tokens_of(events["second"]) == expected_greedy(second, 4)
    assert engine.pool.num_prefix_hit_tokens == len(LONG_PREFIX)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_waiter_whose_sibling_is_aborted_goes_on_alone(overlap):
    """The waiter takes what the aborted sibling had published and computes the rest; a third
    request then waits for the waiter."""
    engine = hash_engine(max_prefill=64, overlap_scheduling=overlap)
    prompts = long_prefix_prompts(3)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", prompt, max_new_tokens=4))
    for _ in range(3):
        engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["r0"]  # still prefilling; the others wait
    engine.abort("r0")
    events = drain_events(engine, [])
    assert events["r0"][-1].finish_reason == "abort"
    for i in (1, 2):
        assert tokens_of(events[f"r{i}"]) == expected_greedy(prompts[i], 4)
    published = engine.pool.num_prefix_hit_tokens - len(LONG_PREFIX)  # r2 hit all of r1's prefix
    assert 64 <= published < len(LONG_PREFIX)  # r1 hit r0's published chunks, not the whole prefix


def test_a_mostly_cached_request_is_held_back_only_a_few_decode_steps():
    """max_waiting_tokens / waiting_served_ratio hold a lone arrival while the batch decodes; a
    next chat turn, whose prefill after its cached prefix is short, joins once
    SHORT_PREFILL_HOLD_STEPS decode steps have passed since the last admission."""
    engine = hash_engine(max_waiting_tokens=100, waiting_served_ratio=10.0)
    first, next_turn = shared_prefix_prompts()[9], shared_prefix_prompts()[9] + [9, 8, 7]
    engine.add_request(GenerateRequest("first", first, max_new_tokens=30))
    engine.step()
    engine.step()  # decoding; its prompt and first token are cached
    engine.add_request(GenerateRequest("unrelated", [40, 41, 42, 43, 44, 45], max_new_tokens=4))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["first"]  # held, as TGI does
    engine.add_request(GenerateRequest("next-turn", next_turn, max_new_tokens=4))
    engine.scheduler.waiting.rotate(1)  # (the next turn first in the queue)
    events, decode_steps = [], 2  # "first" decoded twice since its admission
    while "next-turn" not in [r.request_id for r in engine.scheduler.running]:
        events += [event for event in engine.step() if event.request_id == "next-turn"]
        decode_steps += 1
    assert decode_steps == SHORT_PREFILL_HOLD_STEPS  # it joins the decode step that reaches the hold
    assert [r.request_id for r in engine.scheduler.running] == ["first", "next-turn", "unrelated"]
    events += drain_events(engine, [])["next-turn"]
    assert tokens_of(events) == expected_greedy(next_turn, 4)
