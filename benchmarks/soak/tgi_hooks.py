"""Schemathesis hooks for the soak (loaded through SCHEMATHESIS_HOOKS=benchmarks.soak.tgi_hooks by the soak):
TGI's behaviour that an OpenAPI document cannot state.

`negative_data_rejection_tgi` replaces the built-in `negative_data_rejection` (switched off in the
soak's schemathesis.toml) and runs it, except where TGI rejects invalid data otherwise or not at all:
- A streamed request (`stream: true`, or /generate_stream) is validated inside the stream, as TGI does
  it: invalid parameters come back as one error event on HTTP 200, not as a 422.
- /tokenize and /chat_tokenize only deserialize and tokenize: TGI validates no parameter there
  (/chat_tokenize runs the chat template and tool mapping only).
- The soak's bounds on lengths (max_new_tokens, inputs) are sufficient for TGI's token budget
  (prompt tokens + max_new_tokens <= max_total_tokens), not necessary: a value beyond them that TGI
  accepts for a short prompt is no finding.
`positive_data_acceptance_tgi` replaces the built-in `positive_data_acceptance` the same way: a tool call
that the token limit cuts short does not parse, and TGI answers it with a 422 tool error
("Tool error: Failed to parse generated text: ..."), whatever the request's validity; and TGI reads every
float parameter as an f32, so a positive double below f32's range (`top_p: 5e-324`) arrives as 0.0 and is
refused as 0.0 would be.
OpenAI-route streams end with `data: [DONE]`, which is no JSON: `after_call` takes it off before the
events are validated against their schemas (the route tests check that it is there).
"""

from __future__ import annotations

import json
import re

import numpy as np
import schemathesis
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

STREAMING_PATHS = frozenset({"/", "/generate_stream", "/invocations", "/v1/chat/completions", "/v1/completions"})
UNVALIDATED_PATHS = frozenset({"/tokenize", "/chat_tokenize"})
SOAK_BOUNDS = re.compile(  # (schemathesis words a violation either way)
    r"(max_new_tokens|max_tokens): Value greater than maximum|\b(inputs|prompt)\b.*String larger than maxLength"
    r"|violates `maximum` at \S*/properties/(max_new_tokens|max_tokens)\b"
    r"|violates `maxLength` at \S*/properties/(inputs|prompt)\b"
)
DONE = b"data: [DONE]\n\n"
CUT_TOOL_CALL = "Tool error: Failed to parse generated text: "


def _is_event_stream(response) -> bool:
    return any(value.startswith("text/event-stream") for value in response.headers.get("content-type", []))


def _first_event(response) -> object:
    for line in response.content.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                return json.loads(line[len(b"data:") :])
            except ValueError:
                return None
    return None


def _violations(message: str) -> list[str]:
    """The invalid components a negative_data_rejection failure names."""
    _, _, component = message.partition("Invalid component:")
    lines = [line.strip().removeprefix("- ").strip() for line in component.strip().splitlines()]
    return [line for line in lines if line and not line.startswith("in body")] or [component.strip()]


def only_soak_bounds(message: str) -> bool:
    return all(SOAK_BOUNDS.search(violation) for violation in _violations(message))


@schemathesis.hook
def after_call(context, case, response) -> None:
    if _is_event_stream(response) and response.content.endswith(DONE):
        response.content = response.content[: -len(DONE)]


@schemathesis.check
def negative_data_rejection_tgi(ctx, response, case) -> bool | None:
    """Invalid data must be rejected: a 4xx, or on a streaming route a 200 stream whose first event is
    TGI's error (`{"error": str, "error_type": str}`, or `{"error": {...}}` on the OpenAI routes)."""
    if case.operation.path in UNVALIDATED_PATHS:
        return None
    if case.operation.path in STREAMING_PATHS and response.status_code == 200 and _is_event_stream(response):
        first = _first_event(response)
        if isinstance(first, dict) and "error" in first:
            return True
    try:
        return negative_data_rejection(ctx, response, case)
    except AssertionError as failure:
        if only_soak_bounds(getattr(failure, "message", str(failure))):
            return None
        raise


def _has_f32_zero(value: object) -> bool:
    """Whether a JSON value holds a nonzero float that f32 reads as zero (TGI's deserialization)."""
    if isinstance(value, dict):
        return any(_has_f32_zero(item) for item in value.values())
    if isinstance(value, list):
        return any(_has_f32_zero(item) for item in value)
    return isinstance(value, float) and value != 0.0 and np.float32(value) == 0.0


@schemathesis.check
def positive_data_acceptance_tgi(ctx, response, case) -> bool | None:
    """Valid data must be accepted, except a tool call cut short by the token limit (TGI's 422 tool error)
    and a float that TGI's f32 reads as zero where zero is out of range."""
    if response.status_code == 422 and _has_f32_zero(case.body):
        return None
    if response.status_code == 422 and case.operation.path in ("/v1/chat/completions", "/invocations"):
        try:
            body = json.loads(response.content)
        except ValueError:
            body = None
        if isinstance(body, dict) and str(body.get("error", "")).startswith(CUT_TOOL_CALL):
            return None
    return positive_data_acceptance(ctx, response, case)
