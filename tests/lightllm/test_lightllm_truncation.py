"""long_truncation_mode arithmetic: which tokens head/center keep, at the exact boundaries."""

from __future__ import annotations

import pytest

from tgi_compat.api.lightllm.truncation import kept_length, truncate_long_prompt

PROMPT = list(range(10))


@pytest.mark.parametrize("mode", ["head", "center"])
def test_exact_fit_is_untouched(mode):
    result = truncate_long_prompt(PROMPT, mode, budget=10)
    assert result.prompt_ids == PROMPT and result.num_dropped == 0


def test_one_over_head_drops_the_first_token():
    result = truncate_long_prompt(PROMPT, "head", budget=9)
    assert result.prompt_ids == list(range(1, 10)) and result.num_dropped == 1


def test_one_over_center_drops_the_middle_token():
    # budget 9: first floor(9/2)=4 and last 5
    result = truncate_long_prompt(PROMPT, "center", budget=9)
    assert result.prompt_ids == [0, 1, 2, 3, 5, 6, 7, 8, 9] and result.num_dropped == 1


def test_center_even_budget_keeps_equal_halves():
    result = truncate_long_prompt(PROMPT, "center", budget=4)
    assert result.prompt_ids == [0, 1, 8, 9] and result.num_dropped == 6


def test_budget_one_keeps_the_last_token_in_both_modes():
    assert truncate_long_prompt(PROMPT, "head", budget=1).prompt_ids == [9]
    # center: floor(1/2) = 0 tokens from the front, 1 from the end
    assert truncate_long_prompt(PROMPT, "center", budget=1).prompt_ids == [9]


@pytest.mark.parametrize("budget", [0, -3])
def test_no_possible_fit_leaves_the_prompt_for_the_length_check(budget):
    result = truncate_long_prompt(PROMPT, "head", budget=budget)
    assert result.prompt_ids == PROMPT and result.num_dropped == 0


def test_kept_length_is_the_tighter_of_both_tgi_checks():
    assert kept_length(max_input_tokens=100, max_total_tokens=200, counted_new_tokens=50) == 100
    assert kept_length(max_input_tokens=100, max_total_tokens=120, counted_new_tokens=50) == 70
    assert kept_length(max_input_tokens=100, max_total_tokens=120, counted_new_tokens=120) == 0


@pytest.mark.parametrize("mode", ["head", "center"])
@pytest.mark.parametrize("length", [1, 2, 7, 10])
@pytest.mark.parametrize("budget", [1, 2, 3, 6, 10, 11])
def test_result_is_the_largest_fitting_length_and_an_ordered_subsequence(mode, length, budget):
    prompt = list(range(100, 100 + length))
    result = truncate_long_prompt(prompt, mode, budget)
    assert len(result.prompt_ids) == min(length, budget)
    assert result.num_dropped == length - len(result.prompt_ids)
    assert result.prompt_ids == sorted(result.prompt_ids) and set(result.prompt_ids) <= set(prompt)
    assert result.prompt_ids[-1] == prompt[-1]  # both modes keep the end of the prompt


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError):
        truncate_long_prompt(PROMPT, "tail", budget=3)
