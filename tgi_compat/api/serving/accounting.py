"""Request-level metric hooks: the generation routes report to ServerMetrics (metrics.py) here."""

from __future__ import annotations

from typing import Any

from tgi_compat.api.protocol.errors import TgiError
from tgi_compat.api.serving.generation import GenerationResult, Timings
from tgi_compat.api.serving.state import AppState
from tgi_compat.api.serving.validation import ValidatedRequest


def received(state: AppState, count: int = 1) -> None:
    state.metrics.request_received(count)


def failed(state: AppState, error: TgiError, span: Any = None) -> None:
    state.metrics.request_failed(error.metric_label)
    if span is not None:
        span.record_error(error.message, error.error_type)


def validated(state: AppState, request: ValidatedRequest) -> None:
    state.metrics.record_input_length(request.input_length, request.max_new_tokens)


def traced(span: Any, result: GenerationResult, timings: Timings) -> None:
    """TGI's `queued` and `infer` phases and the route span's timing fields."""
    start_of_inference = timings.first_event or timings.validated
    span.record_phase("queued", timings.wall_ns(timings.validated), timings.wall_ns(start_of_inference))
    span.record_phase("infer", timings.wall_ns(start_of_inference), timings.wall_ns(timings.finished))
    span.set_timings(timings.durations(result.generated_tokens), seed=result.seed)


def succeeded(
    state: AppState, request: ValidatedRequest, result: GenerationResult, timings: Timings, n: int = 1
) -> None:
    ttft = None if timings.first_event is None else timings.first_event - timings.arrival
    state.metrics.request_succeeded(
        timings.durations(result.generated_tokens),
        input_len=request.input_length,
        generated_tokens=result.generated_tokens,
        max_new_tokens=request.max_new_tokens,
        time_to_first_token_s=ttft,
        finish_reason=result.finish_reason,
        n=n,
        skipped_tokens=result.skipped_tokens,
        adapter=request.adapter_id,
    )
