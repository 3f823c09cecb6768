"""LightLLM's `long_truncation_mode`: fit an over-long prompt instead of refusing it (pure arithmetic).

A prompt "does not fit" when it is longer than `max_input_tokens`, or when it plus the request's
`max_new_tokens` (TGI counts at most MAX_NEW_TOKENS_CHUNK of them, see validation.check_lengths)
exceeds `max_total_tokens`. The kept length N is the largest that fits both:

    N = min(max_input_tokens, max_total_tokens - counted_new_tokens)

  * head:   drop tokens from the start, keep the last N (LightLLM drops the BOS too);
  * center: keep the first floor(N/2) and the last N - floor(N/2), drop the middle.

A prompt that already fits is returned unchanged. When N < 1 nothing can fit; the prompt is left
as it is so that the usual length check answers with TGI's 422.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TruncationMode(enum.StrEnum):
    HEAD = "head"
    CENTER = "center"


@dataclass(frozen=True, slots=True)
class Truncated:
    prompt_ids: list[int]
    num_dropped: int  # prompt tokens removed (0 when the prompt fit)


def kept_length(max_input_tokens: int, max_total_tokens: int, counted_new_tokens: int) -> int:
    """The largest prompt length that passes both TGI length checks (may be <= 0)."""
    return min(max_input_tokens, max_total_tokens - counted_new_tokens)


def truncate_long_prompt(prompt_ids: list[int], mode: TruncationMode | str, budget: int) -> Truncated:
    """Keep `budget` tokens of `prompt_ids` the way `mode` says; unchanged when it already fits."""
    mode = TruncationMode(mode)
    length = len(prompt_ids)
    if length <= budget or budget < 1:
        return Truncated(list(prompt_ids), 0)
    if mode is TruncationMode.HEAD:
        kept = prompt_ids[length - budget :]
    else:
        num_front = budget // 2
        kept = prompt_ids[:num_front] + prompt_ids[length - (budget - num_front) :]
    return Truncated(kept, length - budget)
