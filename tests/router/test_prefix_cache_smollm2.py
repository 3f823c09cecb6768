"""Prefix caching with the real embedded SmolLM2: greedy tokens and prompt logprobs are the same with
the cache on as off, alone, batched, across preemption, chunked through a cached prefix, overlapped.

Every engine here is built on the session's SmolLM2 runner (one model load), each with its own
empty KV pool; the session engine's cache is flushed afterwards, since these runs overwrite slots.
"""

from __future__ import annotations

import pytest
from smollm2_cases import SMOLLM2_PROMPTS, smollm2_engine_config

from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest, SamplingParams

MAX_NEW = 3
SYSTEM = SMOLLM2_PROMPTS[8] + SMOLLM2_PROMPTS[5]  # a shared "system prompt" of natural text
FIRST_TURNS = [SYSTEM + p for p in SMOLLM2_PROMPTS[:10]]
PROMPTS = FIRST_TURNS + [turn + SMOLLM2_PROMPTS[(i + 3) % 12] for i, turn in enumerate(FIRST_TURNS)]  # 20


class _SmallerPool:
    """The SmolLM2 runner behind a smaller KV pool, to force preemptions."""

    def __init__(self, runner, num_kv_slots: int) -> None:
        self.runner, self.num_kv_slots = runner, num_kv_slots
        self.model_config, self.max_seq_len = runner.model_config, runner.max_seq_len
        self.dtype, self.device = runner.dtype, runner.device

    def forward(self, batch):
        return self.runner.forward(batch)


@pytest.fixture(scope="module")
def smollm2_runner(smollm2_llm):
    yield smollm2_llm.engine.executor.runner
    smollm2_llm.engine.pool.flush_prefix_cache()  # its cached slots were overwritten here


def make_engine(runner, **overrides) -> EngineCore:
    return EngineCore(smollm2_engine_config(**overrides), runner, runner.model_config)


def run(engine: EngineCore, prompts: list[list[int]], tag: str, **fields) -> list[list[int]]:
    """Every prompt at once, to completion; token ids in prompt order."""
    fields = {"max_new_tokens": MAX_NEW, "ignore_eos": True} | fields
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"{tag}{i}", prompt, **fields))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
    assert engine.pool.is_full_free()
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def cache_off_tokens(smollm2_runner) -> list[list[int]]:
    return run(make_engine(smollm2_runner, prefix_caching=False), PROMPTS, "off")


def test_alone_one_request_at_a_time(smollm2_runner, cache_off_tokens):
    engine = make_engine(smollm2_runner)
    chosen = [0, 1, 2, 10, 11, 12]  # first turns, then their second turns
    outputs = [run(engine, [PROMPTS[i]], f"alone{i}-")[0] for i in chosen]
    assert outputs == [cache_off_tokens[i] for i in chosen]
    assert engine.pool.num_prefix_hit_tokens >= 2 * len(SYSTEM) + sum(len(PROMPTS[i]) - 1 for i in (0, 1, 2))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(max_batch_prefill_tokens=48, overlap_scheduling=True),  # prompts chunked after their hits
    ],
    ids=["batched", "chunked-overlap"],
)
def test_concurrent_batches(smollm2_runner, cache_off_tokens, overrides):
    engine = make_engine(smollm2_runner, **overrides)
    assert run(engine, FIRST_TURNS[:3], "warm") == cache_off_tokens[:3]
    assert run(engine, PROMPTS, "all") == cache_off_tokens  # every prompt has a cached prefix now
    assert engine.pool.num_prefix_hit_tokens >= 3 * (len(FIRST_TURNS[0]) - 1) + 17 * len(SYSTEM)


def test_across_preemption_with_overlap(smollm2_runner):
    """A pool of 90 slots and optimistic admission: requests are preempted and come back as hits."""
    prompts = PROMPTS[:4] + PROMPTS[10:14]
    outputs, engines = [], []
    for caching in (False, True):
        runner = _SmallerPool(smollm2_runner, num_kv_slots=90)
        engine = make_engine(
            runner,
            prefix_caching=caching,
            router_token_ratio=1.0,
            router_max_new_token_len=1,
            overlap_scheduling=True,
        )
        outputs.append(run(engine, prompts, "p", max_new_tokens=10, ignore_eos=False))  # (ignore_eos: no optimism)
        engines.append(engine)
    assert outputs[1] == outputs[0]
    assert engines[1].stats.num_preemptions > 0 and engines[1].pool.num_prefix_hit_tokens > 0


def test_prefill_logprobs_are_the_same_on_and_off(smollm2_runner):
    prompts = PROMPTS[::4]
    on, off = make_engine(smollm2_runner), make_engine(smollm2_runner, prefix_caching=False)
    run(on, prompts, "warm")  # every prompt is cached now; prompt logprobs must not use it
    hits = on.pool.num_prefix_hit_tokens
    scored = []
    for engine in (on, off):
        for i, prompt in enumerate(prompts):
            top_2 = SamplingParams(top_n_tokens=2)
            engine.add_request(GenerateRequest(f"s{i}", prompt, top_2, max_new_tokens=2, prompt_logprobs=True))
        events = {}
        while engine.has_unfinished():
            for event in engine.step():
                if event.prompt_logprobs is not None:
                    events[event.request_id] = (event.prompt_logprobs, event.prompt_top_tokens)
        scored.append(events)
    assert on.pool.num_prefix_hit_tokens == hits
    for request_id, (logprobs, top) in scored[1].items():
        on_logprobs, on_top = scored[0][request_id]
        assert on_logprobs[0] is None and logprobs[0] is None
        assert on_logprobs[1:] == pytest.approx(logprobs[1:], abs=1e-4)
        assert [[t.token_id for t in row] for row in on_top] == [[t.token_id for t in row] for row in top]


# A "system prompt" past MIN_SHARED_PREFILL_TOKENS: the natural prompts, four times in different orders.
_TEXTS = [p for i, p in enumerate(SMOLLM2_PROMPTS) if i != 10]
LONG_SYSTEM = [t for shift in range(4) for p in _TEXTS[shift:] + _TEXTS[:shift] for t in p]
LONG_PROMPTS = [LONG_SYSTEM + SMOLLM2_PROMPTS[i] for i in (0, 1, 2, 4)]  # no two share a first token


@pytest.fixture(scope="module")
def long_prompts_off(smollm2_runner) -> list[list[int]]:
    return run(make_engine(smollm2_runner, prefix_caching=False), LONG_PROMPTS, "loff")


def test_requests_sent_together_compute_their_shared_prefix_once(smollm2_runner, long_prompts_off):
    """Four requests arrive together: the first prefills the system prompt (chunk by chunk), the
    others wait for it and take it from the cache; the tokens are those of the cache off.
    (Overlap scheduling: tests/router/test_prefix_cache_engine.py, on the stand-in model.)"""
    assert len(LONG_SYSTEM) >= 256
    engine = make_engine(smollm2_runner, max_batch_prefill_tokens=128)
    assert run(engine, LONG_PROMPTS, "l") == long_prompts_off
    num_shared = len(LONG_SYSTEM) * (len(LONG_PROMPTS) - 1)
    assert engine.pool.num_prefix_hit_tokens == num_shared
    assert engine.stats.num_prompt_tokens == sum(map(len, LONG_PROMPTS)) - num_shared


def test_a_waiter_whose_sibling_is_aborted_goes_on_alone(smollm2_runner, long_prompts_off):
    engine = make_engine(smollm2_runner, max_batch_prefill_tokens=64)
    for i, prompt in enumerate(LONG_PROMPTS[:2]):
        engine.add_request(GenerateRequest(f"a{i}", prompt, max_new_tokens=MAX_NEW, ignore_eos=True))
    engine.step()
    engine.step()  # a0 has prefilled and published 128 tokens of the system prompt; a1 waits
    assert [r.request_id for r in engine.scheduler.running] == ["a0"]
    engine.abort("a0")
    tokens: list[int] = []
    while engine.has_unfinished():
        for event in engine.step():
            tokens += event.token_ids if event.request_id == "a1" else []
    assert tokens == long_prompts_off[1]
    assert engine.pool.num_prefix_hit_tokens == 128  # what a0 published; a1 computed the rest itself
    assert engine.pool.is_full_free()


def test_a_second_chat_turn_hits_the_first_turns_prompt_and_answer(smollm2_runner, smollm2_tokenizer):
    """A chat client sends back the model's answer as the assistant message: the chat template
    re-renders it to the tokens the model generated, which the first turn left in the cache."""
    engine = make_engine(smollm2_runner)
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def render(messages) -> list[int]:
        text = smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return smollm2_tokenizer(text, add_special_tokens=False).input_ids

    first_prompt = render(messages)
    [answer] = run(engine, [first_prompt], "turn1-", max_new_tokens=12, ignore_eos=False)
    messages += [
        {"role": "assistant", "content": smollm2_tokenizer.decode(answer, skip_special_tokens=True)},
        {"role": "user", "content": "And of Germany?"},
    ]
    second_prompt = render(messages)
    hits_before = engine.pool.num_prefix_hit_tokens
    [second] = run(engine, [second_prompt], "turn2-", max_new_tokens=6, ignore_eos=False)
    # every token but the answer's last (fed to no step, so its K/V was never written)
    assert engine.pool.num_prefix_hit_tokens - hits_before == len(first_prompt) + len(answer) - 1
    assert second_prompt[: len(first_prompt) + len(answer)] == first_prompt + answer
    assert (
        second
        == run(
            make_engine(smollm2_runner, prefix_caching=False),
            [second_prompt],
            "off2-",
            max_new_tokens=6,
            ignore_eos=False,
        )[0]
    )
