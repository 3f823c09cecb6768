"""Admission: may one more waiting request start now? (LightLLM's future-memory estimate.)

Every running request and the candidate is a pair (a, b): a = tokens it holds (prompt + generated,
or prompt + 1 for a request that has not generated yet), b = tokens it may still add. Sorted by b
descending, with A_i = a_1 + ... + a_i, the peak future KV use is max_i(A_i + i * b_i): at the
instant the i-th longest request finishes, the i requests with budget >= b_i are alive and each has
grown by b_i, while all the shorter ones have finished and freed their slots. Usage is piecewise
linear in time, so its maximum sits at one of these instants.

The estimate of b is the worst case (max_new_tokens) when the pool is "busy" (used / total >=
router_token_ratio; the default ratio 0.0 makes it always busy) or the request ignores EOS;
otherwise the optimistic min(max_new, max(1.1 * generated, router_max_new_token_len)). If an
optimistic guess is wrong, the scheduler preempts the newest request; nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestTokens:
    """What admission needs to know of one request: lengths only, no state."""

    num_prompt_tokens: int
    num_generated_tokens: int
    max_new_tokens: int
    ignore_eos: bool = False
    num_shared_tokens: int = 0  # its prefix in the prefix cache, held once for all in `num_shared_slots`


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    num_kv_slots: int  # LightLLM max_total_token_num
    max_running_requests: int  # LightLLM running_max_req_size
    router_token_ratio: float = 0.0
    router_max_new_token_len: int = 1024


def can_admit(
    running: Sequence[RequestTokens],
    candidate: RequestTokens,
    limits: AdmissionLimits,
    num_used_slots: int,
    prefill_budget_left: int,
    num_shared_slots: int = 0,
) -> bool:
    """True when `candidate` may join `running` this step.

    Three gates: the step still has prefill-token budget (a long prompt is chunked, so any budget
    left starts it), the running-request cap, and the future-memory peak below the pool size.
    With prefix caching, `num_used_slots` leaves out the evictable cache (it is as good as free)
    and the cached prefixes running requests share count once, as `num_shared_slots` (LightLLM's
    frozen tokens).
    """
    if prefill_budget_left <= 0 or len(running) + 1 > limits.max_running_requests:
        return False
    is_busy = num_used_slots / limits.num_kv_slots >= limits.router_token_ratio
    needs = [_future_need(r, is_busy, limits.router_max_new_token_len) for r in (*running, candidate)]
    needs.sort(key=lambda need: need[1], reverse=True)
    peak, held_so_far = 0, 0
    for i, (held, remaining) in enumerate(needs, start=1):
        held_so_far += held
        peak = max(peak, held_so_far + i * remaining)
    return peak < limits.num_kv_slots - num_shared_slots


def _future_need(request: RequestTokens, is_busy: bool, router_max_new_token_len: int) -> tuple[int, int]:
    """(a, b): tokens held now, tokens it may still add."""
    generated = request.num_generated_tokens
    if is_busy or request.ignore_eos:
        expected_new = request.max_new_tokens
    else:
        expected_new = min(request.max_new_tokens, max(int(1.1 * generated), router_max_new_token_len))
    held = request.num_prompt_tokens + max(generated, 1) - request.num_shared_tokens
    remaining = max(0, expected_new - generated - 1)
    return held, remaining


def images_fit(held: Sequence[int], images: int, max_images: int | None) -> bool:
    """Whether a request with `images` may start beside running requests holding `held` images' keys each: a
    cross-attending model's, whose keys have room for `max_images` (None: no bound). One alone always may start."""
    return max_images is None or images == 0 or sum(held) + images <= max_images or not any(held)
