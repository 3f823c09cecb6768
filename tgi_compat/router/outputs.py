"""What the engine sends back: per request, per step, the new token(s) and their scores.

These are TGI's `Generation` fields before any text: tgi_compat owns detokenization.
Encoded with msgspec (array_like) when they cross the process boundary.
"""

from __future__ import annotations

import msgspec


class TopToken(msgspec.Struct, array_like=True, frozen=True):
    token_id: int
    logprob: float


class TokenEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    token_ids: list[int] = []  # new ids this step (usually one)
    logprobs: list[float] = []  # logprob of each new id under the processed distribution
    top_tokens: list[list[TopToken]] = []  # per new id, when top_n_tokens > 0
    # Sent once, with the first event, when the request asked for prompt logprobs.
    prompt_logprobs: list[float | None] | None = None  # first entry None
    prompt_top_tokens: list[list[TopToken]] | None = None
    finish_reason: str | None = None  # a FinishReason value on the last event
    error: str | None = None  # with finish_reason "error"
    seed: int | None = None  # the seed used, when the request sampled
    num_prompt_tokens: int = 0  # prompt tokens the engine actually ran (after healing)
    num_cached_tokens: int = 0  # of those, found in the prefix cache (not computed); first event only
    pooled: list[float] | None = None  # a pooling model's output for the prompt (embedding or scores), its only event
