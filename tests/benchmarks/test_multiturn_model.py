"""benchmarks.multiturn_model's step simulation on made-up turn lengths."""

from types import SimpleNamespace

import pytest

from benchmarks.backends import RequestSpec
from benchmarks.multiturn import Turn
from benchmarks.multiturn_model import Engine, TurnCost, simulate, turn_costs


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


def test_own_answers_are_cached_as_far_as_they_re_tokenize():
    """A follow-up's uncached tokens: its question (+2 for the separator), and the previous answer's
    tokens past those that re-tokenize to themselves."""

    def words(text, add_special_tokens):
        return SimpleNamespace(input_ids=text.split())

    conversation = [Turn(RequestSpec("a b c", 3, 40), "a b c"), Turn(RequestSpec("", 0, 20), "d e")]
    first, follow_up = turn_costs(words, [conversation], own_history=True)[0]
    assert first == TurnCost(3, 3, 40) and follow_up == TurnCost(3 + 40 + 4, 4, 20)
    _, partly = turn_costs(words, [conversation], own_history=True, answer_ids_cached=10)[0]
    assert partly == TurnCost(47, 4 + 30, 20)
