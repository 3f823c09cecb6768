"""Speculative decoding in the engine, over a stand-in model that reads its context through the KV slots:
the real scheduler, executor and sampler verify n-gram drafts, and the output must be the plain path's."""

from __future__ import annotations

import pytest
import torch
from router_fakes import EOS, HashRunner, drain, hash_engine

from tgi_compat.router.request import GenerateRequest, SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.policy import StepCostTable


class LoopRunner(HashRunner):
    """Predicts from the last two ids only (read through the slots), so outputs fall into loops that
    n-gram drafts catch, and break out of them now and then (a draft is then rejected)."""

    def logits_after(self, context: list[int]) -> torch.Tensor:
        previous = context[-2] if len(context) > 1 else 0
        target = (context[-1] * 5 + previous * 3 + (len(context) % 23 == 0)) % self.vocab
        if target in (0, EOS):
            target = EOS + 1
        distance = (torch.arange(self.vocab) - target) % self.vocab
        return -0.6 * distance.float()


SPECULATE = SpeculativeConfig(num_speculative_tokens=4)
GREEDY = SamplingParams()
SAMPLED = SamplingParams(do_sample=True, temperature=0.9, top_k=8, seed=11)


def _prompts(count: int) -> list[list[int]]:
    return [[3 + (i * 7 + j * 5) % 29 for j in range(5 + i % 7)] for i in range(count)]


def _run(speculative, prompts, sampling=GREEDY, *, together=True, num_kv_slots=4096, **request_fields):
    runner = LoopRunner(vocab=32, num_kv_slots=num_kv_slots)
    engine = hash_engine(runner=runner, speculative=speculative, **request_fields.pop("engine", {}))
    events = {}
    batches = [list(enumerate(prompts))] if together else [[pair] for pair in enumerate(prompts)]
    for batch in batches:
        for i, prompt in batch:
            params = dict(max_new_tokens=40) | request_fields
            engine.add_request(GenerateRequest(f"r{i}", list(prompt), _copy(sampling), **params))
        events |= drain(engine)  # (asserts the KV pool is full again)
    return events, engine


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{name: getattr(params, name) for name in SamplingParams.__slots__})


def _outputs(events) -> dict[str, tuple]:
    return {
        rid: (
            [t for e in evs for t in e.token_ids],
            [round(p, 5) for e in evs for p in e.logprobs],
            evs[-1].finish_reason,
        )
        for rid, evs in events.items()
    }


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("together", [True, False], ids=["concurrent", "alone"])
def test_speculation_gives_the_plain_tokens(sampling, together):
    prompts = _prompts(24)
    plain, plain_engine = _run(None, prompts, sampling, together=together)
    speculated, engine = _run(SPECULATE, prompts, sampling, together=together)
    assert _outputs(speculated) == _outputs(plain)
    counters = engine.scheduler.speculator.counters
    report, plain_report = engine.stats.report(force=True), plain_engine.stats.report(force=True)
    assert (report.spec_drafts, report.spec_accepted_tokens) == (counters.num_drafts, counters.num_accepted_tokens)
    # verify chunks generate: they are not counted as prompt tokens
    assert (report.prompt_tokens, report.generated_tokens) == (
        plain_report.prompt_tokens,
        plain_report.generated_tokens,
    )
    assert counters.num_accepted_tokens > 0  # drafts were accepted ...
    assert counters.num_accepted_tokens < counters.num_draft_tokens  # ... and rejected
    # TGI's tgi_request_skipped_tokens: each request's accepted drafts, on its last event
    assert sum(evs[-1].num_skipped_tokens for evs in speculated.values()) == counters.num_accepted_tokens
    # TGI: every accepted token is an event of its own
    assert all(len(e.token_ids) == 1 for evs in speculated.values() for e in evs)


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 9])
def test_length_and_stop_tokens_cut_an_accepted_run(max_new):
    prompts = _prompts(8)
    plain, _ = _run(None, prompts, max_new_tokens=max_new)
    assert _outputs(_run(SPECULATE, prompts, max_new_tokens=max_new)[0]) == _outputs(plain)
    long_plain, _ = _run(None, prompts)
    stop = [t for e in long_plain["r0"][6:] for t in e.token_ids][:2]  # ids that come up mid-output
    stopped, _ = _run(None, prompts, stop_token_ids=stop)
    assert _outputs(_run(SPECULATE, prompts, stop_token_ids=stop)[0]) == _outputs(stopped)


def test_prefix_caching_and_preemption_keep_the_tokens():
    prompts = [_prompts(1)[0] * 3 + [i] for i in range(6)]  # a shared prefix, a pool too small for them all
    optimistic = {"router_token_ratio": 1.0, "router_max_new_token_len": 1}  # admit all: forced preemptions
    plain, _ = _run(None, prompts, num_kv_slots=160, engine=optimistic, max_new_tokens=100)
    speculated, engine = _run(SPECULATE, prompts, num_kv_slots=160, engine=optimistic, max_new_tokens=100)
    assert _outputs(speculated) == _outputs(plain)
    assert engine.stats.num_preemptions > 0
    assert engine.scheduler.speculator.counters.num_accepted_tokens > 0


def test_penalty_rows_run_without_drafts_beside_drafting_rows():
    prompts = _prompts(6)
    penalised = SamplingParams(repetition_penalty=1.3)
    engine = hash_engine(runner=LoopRunner(vocab=32), speculative=SPECULATE)
    plain_engine = hash_engine(runner=LoopRunner(vocab=32))
    for e in (engine, plain_engine):
        for i, prompt in enumerate(prompts):
            sampling = penalised if i % 2 else SamplingParams()
            e.add_request(GenerateRequest(f"r{i}", list(prompt), _copy(sampling), max_new_tokens=30))
    assert _outputs(drain(engine)) == _outputs(drain(plain_engine))
    assert engine.scheduler.speculator.counters.num_accepted_tokens > 0


def test_a_step_cost_table_turns_speculation_off_where_it_loses():
    every_row_costs = SpeculativeConfig(4, step_cost=StepCostTable(rows=(1, 2), seconds=(1.0, 2.0)))
    plain, _ = _run(None, _prompts(4))
    speculated, engine = _run(every_row_costs, _prompts(4))
    assert _outputs(speculated) == _outputs(plain)
    assert engine.scheduler.speculator.counters.num_drafts == 0
    flat = SpeculativeConfig(4, step_cost=StepCostTable(rows=(1, 64), seconds=(1.0, 1.01)))
    assert _run(flat, _prompts(4))[1].scheduler.speculator.counters.num_drafts > 0
