"""EngineCore end to end over a stand-in model that reads its context through the KV slots."""

from __future__ import annotations

import pytest
import torch
from router_fakes import HashRunner, drain, hash_engine

from tgi_compat.router.client_api import Refusal, RequestRejectedError
from tgi_compat.router.request import GenerateRequest, SamplingParams


def prompts(n: int, length: int = 7) -> list[list[int]]:
    return [[(5 * i + 3 * k + 1) % 60 + 3 for k in range(length + i % 5)] for i in range(n)]


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def run_alone(prompt, max_new=12, **kwargs) -> list[int]:
    engine = hash_engine()
    engine.add_request(GenerateRequest("solo", prompt, max_new_tokens=max_new, **kwargs))
    return tokens_of(drain(engine)["solo"])


def expected_greedy(prompt, max_new) -> list[int]:
    runner, context = HashRunner(), list(prompt)
    for _ in range(max_new):
        context.append(int(runner.logits_after(context).argmax()))
    return context[len(prompt) :]


def test_a_request_alone_follows_the_model():
    prompt = prompts(1)[0]
    assert run_alone(prompt) == expected_greedy(prompt, 12)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(),  # everything fits
        dict(max_prefill=5),  # prompts chunked, sharing steps with decodes
        dict(max_running=3),  # queueing
        dict(num_kv_slots=60, router_token_ratio=1.0, router_max_new_token_len=1),  # forced preemptions
    ],
    ids=["batched", "chunked", "queued", "preempted"],
)
def test_batched_outputs_equal_each_request_alone(engine_kwargs):
    engine = hash_engine(**engine_kwargs)
    batch = prompts(10)
    for i, prompt in enumerate(batch):
        engine.add_request(GenerateRequest(f"r{i}", prompt, max_new_tokens=12))
    events = drain(engine)
    for i, prompt in enumerate(batch):
        assert tokens_of(events[f"r{i}"]) == expected_greedy(prompt, 12), f"r{i}"
        assert events[f"r{i}"][-1].finish_reason == "length"


def test_preemption_really_happens_under_memory_pressure():
    engine = hash_engine(num_kv_slots=60, router_token_ratio=1.0, router_max_new_token_len=1)
    for i, prompt in enumerate(prompts(10)):
        engine.add_request(GenerateRequest(f"r{i}", prompt, max_new_tokens=12))
    preemptions = 0
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        preemptions += len(plan.preempted)
        engine.scheduler.update(plan, engine.executor.execute(plan))
    assert preemptions > 0 and engine.pool.is_full_free()


def test_seeded_sampling_is_the_same_alone_and_batched():
    prompt = prompts(1)[0]
    sampling = SamplingParams(do_sample=True, seed=1234, temperature=2.0)
    alone = run_alone(prompt, sampling=sampling)
    engine = hash_engine(max_prefill=4)
    for i, other in enumerate(prompts(5)):
        engine.add_request(GenerateRequest(f"o{i}", other, SamplingParams(do_sample=True), max_new_tokens=12))
    engine.add_request(GenerateRequest("seeded", prompt, sampling, max_new_tokens=12))
    events = drain(engine)
    assert tokens_of(events["seeded"]) == alone
    assert events["seeded"][-1].seed == 1234
    assert all(e.seed is not None for e in events["o0"])


def test_greedy_requests_report_no_seed():
    engine = hash_engine()
    engine.add_request(GenerateRequest("g", prompts(1)[0], max_new_tokens=3))
    assert all(e.seed is None for e in drain(engine)["g"])


def test_prompt_logprobs_match_the_model_across_chunks():
    prompt = prompts(1, length=11)[0]
    engine = hash_engine(max_prefill=4)
    engine.add_request(
        GenerateRequest("p", prompt, SamplingParams(top_n_tokens=2), max_new_tokens=2, prompt_logprobs=True)
    )
    first = drain(engine)["p"][0]
    runner = HashRunner()
    expected = [None] + [
        float(torch.log_softmax(runner.logits_after(prompt[:k]), -1)[prompt[k]]) for k in range(1, len(prompt))
    ]
    assert first.prompt_logprobs == pytest.approx(expected)
    assert len(first.prompt_top_tokens) == len(prompt) and first.prompt_top_tokens[0] == []
    assert all(len(top) == 2 for top in first.prompt_top_tokens[1:])


def test_a_failing_request_is_isolated_and_the_engine_keeps_serving():
    runner = HashRunner()
    runner.fail_on_token = 0
    engine = hash_engine(runner=runner)
    engine.add_request(GenerateRequest("bad", [5, 0, 7], max_new_tokens=4))
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(GenerateRequest(f"ok{i}", prompt, max_new_tokens=4))
    events = drain(engine)
    assert events["bad"][-1].finish_reason == "error" and "poisoned" in events["bad"][-1].error
    for i, prompt in enumerate(prompts(3)):
        assert tokens_of(events[f"ok{i}"]) == expected_greedy(prompt, 4)


def test_abort_frees_the_slots_at_the_next_step():
    engine = hash_engine()
    engine.add_request(GenerateRequest("a", prompts(1)[0], max_new_tokens=100))
    engine.step()
    engine.step()
    assert engine.pool.num_used_slots > 0
    engine.abort("a")
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("a", "abort")]
    assert engine.pool.is_full_free() and not engine.has_unfinished()


@pytest.mark.parametrize(
    "request_kwargs,reason,values",
    [
        (dict(prompt_ids=[]), Refusal.EMPTY_PROMPT, ()),
        (dict(max_new_tokens=0), Refusal.MAX_NEW_TOKENS, ()),
        (dict(sampling=SamplingParams(temperature=0.0)), Refusal.TEMPERATURE, ()),
        (dict(sampling=SamplingParams(top_p=0.0)), Refusal.TOP_P, ()),
        (dict(sampling=SamplingParams(frequency_penalty=3.0)), Refusal.FREQUENCY_PENALTY, ()),
        (dict(sampling=SamplingParams(seed=1 << 64)), Refusal.SEED, ()),
        (dict(max_new_tokens=5000), Refusal.TOTAL_TOKENS, ("max_total_tokens", 2, 5000)),
        (dict(prompt_ids=[5, 10**6, 7]), Refusal.PROMPT_TOKEN, (10**6, "vocab_size")),
        (dict(prompt_ids=[5, -1]), Refusal.PROMPT_TOKEN, (-1, "vocab_size")),
        (dict(adapter_id="a1"), Refusal.LORA_OFF, ("a1",)),
    ],
)
def test_invalid_requests_are_rejected_before_admission(request_kwargs, reason, values):
    """Codes, never text: the API maps them to TGI's messages (tests/api/test_validation_catalogue.py)."""
    engine = hash_engine()
    fields = dict(request_id="x", prompt_ids=[5, 6]) | request_kwargs
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_request(GenerateRequest(**fields))
    limits = {"max_total_tokens": engine.info.max_total_tokens, "vocab_size": engine.info.vocab_size}
    assert (refused.value.reason, refused.value.values) == (reason, tuple(limits.get(v, v) for v in values))
    assert not engine.has_unfinished()


def test_a_request_id_already_in_the_engine_is_refused():
    engine = hash_engine()
    engine.add_request(GenerateRequest("x", [5, 6]))
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_request(GenerateRequest("x", [5, 6]))
    assert (refused.value.reason, refused.value.values) == (Refusal.DUPLICATE_ID, ("x",))


def test_stats_count_steps_tokens_and_occupancy():
    engine = hash_engine(max_prefill=4)
    engine.stats.accumulator.interval_s = 0.0
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(GenerateRequest(f"r{i}", prompt, max_new_tokens=5))
    engine.step()
    mid = engine.stats.report()
    assert mid.running == 1 and mid.queue_size == 2 and mid.kv_used == 4 and mid.kv_total == 4096
    assert mid.steps[0].method == "prefill" and mid.steps[0].new_batch_size == 1
    drain(engine)
    final = engine.stats.report()
    assert final.generated_tokens == 15 and final.prompt_tokens == sum(len(p) for p in prompts(3))
    assert final.running == 0 and final.kv_used == 0 and final.steps[-1].method == "decode"


class GreedyChoosingRunner(HashRunner):
    """Answers a greedy-only step with the choice, as a vocab-parallel ModelRunner does (its logits never
    gathered), and records which steps were greedy-only."""

    def __init__(self) -> None:
        super().__init__()
        self.greedy_only_steps: list[bool] = []

    def forward(self, batch):
        from tgi_compat.kernels.sampling.greedy_pick import greedy_pick_ref
        from tgi_compat.modeling.parallel.vocab_logits import GreedyChoice

        logits = super().forward(batch)
        self.greedy_only_steps.append(batch.greedy_only)
        return GreedyChoice(*greedy_pick_ref(logits)) if batch.greedy_only else logits


def test_greedy_only_steps_answered_with_the_choice_give_the_sampler_s_tokens_and_logprobs():
    """Steps whose every request is plain greedy are flagged greedy_only; a runner that then answers with the
    greedy choice yields the tokens and logprobs the sampler yields from the logits. A sampling request, top-n
    tokens or prompt logprobs in a step keep it on the logits."""

    def run(runner, with_others: bool) -> dict[str, list]:
        engine = hash_engine(runner=runner)
        for i, prompt in enumerate(prompts(4)):
            engine.add_request(GenerateRequest(f"g{i}", prompt, max_new_tokens=6))
        if with_others:
            engine.add_request(
                GenerateRequest("s", prompts(1)[0], max_new_tokens=3, sampling=SamplingParams(do_sample=True, seed=3))
            )
            engine.add_request(
                GenerateRequest("t", prompts(2)[1], max_new_tokens=3, sampling=SamplingParams(top_n_tokens=2))
            )
            engine.add_request(GenerateRequest("p", prompts(3)[2], max_new_tokens=3, prompt_logprobs=True))
        return drain(engine)

    for with_others in (False, True):
        choosing = GreedyChoosingRunner()
        ours, reference = run(choosing, with_others), run(HashRunner(), with_others)
        for request_id, events in reference.items():
            assert tokens_of(ours[request_id]) == tokens_of(events), request_id
            assert [p for e in ours[request_id] for p in e.logprobs] == pytest.approx(
                [p for e in events for p in e.logprobs], abs=1e-6
            )
        flagged = sum(choosing.greedy_only_steps)
        assert flagged > 0  # the plain-greedy steps (all of them without the others; the last ones with them)
        assert (flagged == len(choosing.greedy_only_steps)) == (not with_others)
