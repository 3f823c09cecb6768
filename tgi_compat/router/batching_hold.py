"""TGI's batching hold: while the running batch decodes, the waiting requests join it only once enough of
them wait (waiting_served_ratio x the batch) or after max_waiting_tokens decode steps without an admission,
so a few late requests do not interrupt every decode step with a prefill. With prefix caching a request
whose prefill is short after its cached prefix is held for fewer steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from tgi_compat.router.prefix_cache import PrefixCache
from tgi_compat.router.request import Request

# A waiting request whose prompt is mostly cached (a chat's next turn, a shared system prompt) has a
# short prefill, at most this many tokens: it is held for fewer decode steps.
MAX_UNHELD_PREFILL_TOKENS = 512
# ... at most this many. Not zero: a step with any prefill runs eager, not as a CUDA graph (Llama-3-8B
# at 64 rows: ~17 ms against ~7 ms), and 64 chat conversations send a next turn every ~2 decode steps,
# so admitting each at once made nearly every step an eager one (multi-turn chat at 64 conversations:
# 3,291 output tok/s, ~19 ms a step). Held this long, one eager step admits ~4 turns. A step-level
# model of that replay (an eager step 10-15 ms dearer) gives, against no hold, +3% throughput at 4
# steps, +9-11% at 8, +11-14% at 12, and TTFT p50 21 -> 47 / 46 / 70 ms: 8. The hold adds at most
# this many decode steps to a turn's TTFT.
SHORT_PREFILL_HOLD_STEPS = 8


class BatchingHold:
    """Counts the decode steps since the last admission and says when the waiting requests may join."""

    def __init__(self, max_waiting_tokens: int, waiting_served_ratio: float, capped: bool = False) -> None:
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_served_ratio = waiting_served_ratio
        self.decode_steps = 0
        # `capped`: a mixed step's prefill cap (--max-mixed-prefill-tokens) admits a released queue over several
        # steps, so it stays released until it drains, or each capped admission would wait out a whole hold again
        self.capped = capped
        self.draining = False

    def admitted(self) -> None:
        self.decode_steps = 0

    def released(self, waiting: Sequence[Request]) -> None:
        """After the admission a due step made: under the cap, whoever still waits joins at the next steps."""
        self.draining = self.capped and bool(waiting)

    def decode_step_is_due(self, waiting: Sequence[Request], num_running: int, cache: PrefixCache | None) -> bool:
        """Counts one more decode step; True when enough requests wait, or they have waited
        max_waiting_tokens steps, or (prefix caching) the first one in the queue has a short prefill
        after its cached prefix and SHORT_PREFILL_HOLD_STEPS have passed."""
        self.decode_steps += 1
        if self.draining and waiting:
            return True
        if len(waiting) >= int(num_running * self.waiting_served_ratio):
            return True
        if self.decode_steps >= self.max_waiting_tokens:
            return True
        return (
            cache is not None
            and self.decode_steps >= SHORT_PREFILL_HOLD_STEPS
            and bool(waiting)
            and _has_a_short_cached_prefill(cache, waiting[0])
        )


def _has_a_short_cached_prefill(cache: PrefixCache, request: Request) -> bool:
    """Most of the prompt is cached and what is left is short (MAX_UNHELD_PREFILL_TOKENS)."""
    if request.output_ids or request.needs_prompt_logprobs:
        return False
    prompt = request.params.prompt_ids
    num_cached = min(cache.matched_length(request.cache_ids(len(prompt))), len(prompt) - 1)
    num_new = len(prompt) - num_cached
    return num_new <= min(num_cached, MAX_UNHELD_PREFILL_TOKENS)
