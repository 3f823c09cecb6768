"""The one place that decides a request is finished by what it generated: its length, EOS, its stop ids.

A request's length budget is its `max_new_tokens`, plus, under token healing, the tokens that only
re-covered the removed prompt text (they add nothing past the prompt, so TGI's client never sees them
counted). The API stops only on stop strings, which are text.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_compat.router.admission import RequestTokens
from tgi_compat.router.request import FinishReason, Request
from tgi_compat.router.sampling.token_healing import VocabularyTable, is_prefix_only, remaining_prefix


@dataclass(slots=True)
class HealingCount:
    """Counts a healing request's tokens that re-cover the removed prompt text, up to `max_uncounted`
    (what keeps prompt + generated within max_total_tokens)."""

    table: VocabularyTable
    pending: bytes  # the removed text not re-covered yet
    max_uncounted: int
    num_uncounted: int = 0

    def push(self, token_id: int) -> None:
        if self.pending:
            self.num_uncounted += is_prefix_only(self.table, self.pending, token_id)
            self.pending = remaining_prefix(self.table, self.pending, [token_id])


def length_budget(request: Request) -> int:
    """Tokens the request may generate in all."""
    healing = request.healing
    if healing is None:
        return request.params.max_new_tokens
    return request.params.max_new_tokens + min(healing.num_uncounted, healing.max_uncounted)


def is_at_length_cap(request: Request) -> bool:
    """Its newest token, still on the device, is its last (only ever true with a pending token)."""
    return request.num_output_tokens >= length_budget(request)


def stop_reason(request: Request, token_id: int, eos_token_ids: frozenset[int]) -> FinishReason | None:
    """Why `token_id`, just appended, ends the request; None when it goes on. TGI's order: length first,
    then EOS, then stop ids."""
    params = request.params
    if len(request.output_ids) >= length_budget(request):
        return FinishReason.LENGTH
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.EOS_TOKEN
    if token_id in params.stop_token_ids:
        return FinishReason.STOP_TOKEN
    return None


def admission_tokens(request: Request) -> RequestTokens:
    """What admission counts of a request: its lengths and its length budget."""
    params, prefix = request.params, request.cached_prefix
    return RequestTokens(
        request.num_prompt_tokens,
        len(request.output_ids),
        length_budget(request),
        params.ignore_eos,
        0 if prefix is None else prefix.num_tokens,
    )
