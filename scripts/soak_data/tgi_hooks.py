"""Schemathesis hooks for the soak (loaded through SCHEMATHESIS_HOOKS=tgi_hooks by scripts/soak.py):
TGI's behaviour that an OpenAPI document cannot state.

- A streamed request (`stream: true`, or /generate_stream) is validated inside the stream, as TGI does
  it: invalid parameters come back as one error event on HTTP 200, not as a 422. The built-in
  `negative_data_rejection` is switched off for the streaming routes (schemathesis.toml) and
  `negative_data_rejection_in_streams` runs it instead, counting such an error event as a rejection.
- OpenAI-route streams end with `data: [DONE]`, which is no JSON: it is taken off before the events
  are validated against their schemas (the route tests check that it is there).
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.specs.openapi.checks import negative_data_rejection

STREAMING_PATHS = frozenset({"/", "/generate_stream", "/invocations", "/v1/chat/completions", "/v1/completions"})
DONE = b"data: [DONE]\n\n"


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


@schemathesis.hook
def after_call(context, case, response) -> None:
    if _is_event_stream(response) and response.content.endswith(DONE):
        response.content = response.content[: -len(DONE)]


@schemathesis.check
def negative_data_rejection_in_streams(ctx, response, case) -> bool | None:
    """Invalid data sent to a streaming route must be rejected: a 4xx, or a 200 stream whose first event
    is TGI's error (`{"error": str, "error_type": str}`, or `{"error": {...}}` on the OpenAI routes)."""
    if case.operation.path not in STREAMING_PATHS:
        return None  # the built-in check covers the other routes
    if response.status_code == 200 and _is_event_stream(response):
        first = _first_event(response)
        if isinstance(first, dict) and "error" in first:
            return True
    return negative_data_rejection(ctx, response, case)
