"""benchmarks.multiturn_model's step simulation on made-up turn lengths."""

import pytest

from benchmarks.multiturn_model import Engine, TurnCost, simulate


def chats(new: int | None, num: int = 128, turns: int = 5) -> list[list[TurnCost]]:
    """Prompts growing by 600 tokens a turn; `new` of a follow-up's are uncached (None: all of them).
    Answer lengths differ between conversations, so that their turns arrive one by one."""
    prompts = [600 * (k + 1) for k in range(turns)]
    return [
        [TurnCost(p, p if k == 0 or new is None else new, 40 + (7 * i) % 60) for k, p in enumerate(prompts)]
        for i in range(num)
    ]


def test_without_reuse_the_cache_changes_nothing():
    conversations = chats(new=None)  # every prompt is new and longer than a short prefill
    off = simulate(conversations, 64, cache=False, hold=0, engine=Engine())
    on = simulate(conversations, 64, cache=True, hold=0, engine=Engine())
    assert on == off


def test_reuse_pays_and_holding_short_prefills_saves_eager_steps():
    conversations = chats(new=40)
    off_tps, off_ttft, _ = simulate(conversations, 64, cache=False, hold=0, engine=Engine())
    at_once_tps, at_once_ttft, _ = simulate(conversations, 64, cache=True, hold=0, engine=Engine())
    held_tps, held_ttft, _ = simulate(conversations, 64, cache=True, hold=8, engine=Engine())
    assert at_once_tps > off_tps and at_once_ttft < off_ttft
    assert held_tps > at_once_tps and held_ttft > at_once_ttft
    total_output = sum(t.output for c in conversations for t in c)
    assert simulate(conversations, 64, cache=True, hold=8, engine=Engine())[2] * held_tps == pytest.approx(total_output)
