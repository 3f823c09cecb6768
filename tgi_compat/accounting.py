"""Request-level metric hooks: the generation routes report to ServerMetrics (metrics.py) here."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

from tgi_compat.errors import TgiError
from tgi_compat.generation import GenerationResult, Timings
from tgi_compat.state import AppState
from tgi_compat.validation import ValidatedRequest


def received(state: AppState, count: int = 1) -> None:
    if state.metrics is not None:
        state.metrics.request_received(count)


def failed(state: AppState, error: TgiError) -> None:
    if state.metrics is not None:
        state.metrics.request_failed(error.metric_label)


def validated(state: AppState, request: ValidatedRequest) -> None:
    if state.metrics is not None:
        state.metrics.record_input_length(request.input_length, request.max_new_tokens)


def inflight(state: AppState) -> Any:
    """Context manager counting the request as waiting, then running after `first_token()`."""
    return state.metrics.track_inflight() if state.metrics is not None else nullcontext(None)


def succeeded(state: AppState, request: ValidatedRequest, result: GenerationResult, timings: Timings, n: int = 1) -> None:
    if state.metrics is None:
        return
    total = time.perf_counter() - timings.arrival
    inference = timings.inference_seconds()
    generated = result.generated_tokens
    ttft = None if timings.first_event is None else timings.first_event - timings.arrival
    state.metrics.request_succeeded(
        total_s=total,
        validation_s=max(timings.validated - timings.arrival, 0.0),
        queue_s=timings.queue_seconds(),
        inference_s=inference,
        time_per_token_s=inference / generated if generated else 0.0,
        input_len=request.input_length,
        generated_tokens=generated,
        max_new_tokens=request.max_new_tokens,
        time_to_first_token_s=ttft,
        finish_reason=result.finish_reason,
        n=n,
    )
