"""TGI's durations of one request, in seconds: what its metrics observe and its route span records."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestDurations:
    total_s: float
    validation_s: float
    queue_s: float  # validated -> first token (our prefill included, as TGI's queue)
    inference_s: float  # first token -> end
    time_per_token_s: float  # inference_s over the generated tokens
