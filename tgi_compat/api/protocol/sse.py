"""TGI's SSE framing (docs/contract.md §7) on top of sse-starlette.

Each event is exactly `data:<compact json>\n\n` (axum's `Event::json_data`: no space after the
colon, no `event:`/`id:` lines); a `:\n\n` comment keeps idle connections alive every 15 s.
TGI-native streams end by closing the connection: never a `[DONE]` (the text_generation client
would crash on it). The OpenAI routes add their own `data: [DONE]` with `done_event()`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Message, Send

KEEP_ALIVE_SECONDS = 15


class _KeepAlive(ServerSentEvent):
    def encode(self) -> bytes:
        return b":\n\n"


class _TgiEventSource(EventSourceResponse):
    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        # We set no send_timeout, yet sse-starlette still opens an anyio cancel scope around every
        # send; at thousands of events/s that scope is a measurable share of the API process.
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def data_event(payload_json: str) -> bytes:
    """One SSE event carrying compact JSON (`data:{...}\\n\\n`)."""
    return b"data:" + payload_json.encode("utf-8") + b"\n\n"


def done_event() -> bytes:
    """The OpenAI-style terminator (axum's `Event::data("[DONE]")` writes a space)."""
    return b"data: [DONE]\n\n"


def event_stream(events: AsyncIterator[bytes], headers: Mapping[str, str]) -> EventSourceResponse:
    """HTTP 200 text/event-stream, chunked, one body chunk per event, flushed as produced."""
    return _TgiEventSource(
        events,
        headers=dict(headers),
        ping=KEEP_ALIVE_SECONDS,
        ping_message_factory=_KeepAlive,
        sep="\n",
    )
