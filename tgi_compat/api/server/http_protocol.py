"""uvicorn's httptools protocol with hyper's limits on a request head (TGI serves through hyper 1.x).

hyper refuses a head (request line and headers) longer than its read buffer, 8 KiB + 100 x 4 KiB, or with
more than 100 headers: 431 with no body, then it closes the connection. uvicorn has no such limit (httptools
gathers a header value of any size, and the count is free), so a client could grow this process by sending
heads that never end. The bytes are counted before the parser sees them: the head must end within the first
MAX_HEAD_BYTES of a request, and a header past the hundredth stops the parser.

A head must also arrive within HEAD_READ_TIMEOUT_S (--header-read-timeout), counted from the connection's start or from the end of
its previous response; a connection that takes longer (slowloris) is closed without an answer, as hyper does
when its header read timeout is set. uvicorn's keep-alive timeout still closes idle connections first.

Only the head is counted: a body, and the response that streams tokens, cost nothing more.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 8192 + 4096 * 100  # hyper's DEFAULT_MAX_BUFFER_SIZE: 408 KiB
MAX_HEADERS = 100  # hyper's DEFAULT_MAX_HEADERS
HEAD_READ_TIMEOUT_S = 30.0  # hyper's default header_read_timeout


class _TooManyHeaders(Exception):
    """Raised from the parser's header callback: the only way to stop httptools mid-head."""


class BoundedHeadProtocol(HttpToolsProtocol):
    head_read_timeout_s = HEAD_READ_TIMEOUT_S  # a class attribute: uvicorn makes the protocols itself

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # bytes received of the head being read; None once it is complete
        self._num_headers = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is None:  # a body
            super().data_received(data)
            return
        allowed = MAX_HEAD_BYTES - self._head_bytes
        self._head_bytes += len(data)
        if len(data) <= allowed:
            super().data_received(data)
            return
        if allowed > 0:
            super().data_received(data[:allowed])
        if self.transport.is_closing():
            return
        if self._head_bytes is not None:  # the head did not end within its limit
            self._refuse_head()
        else:
            super().data_received(data[allowed:])

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > MAX_HEADERS:
            raise _TooManyHeaders  # httptools stops; uvicorn answers through send_400_response
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._num_headers > MAX_HEADERS:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes, self._num_headers = 0, 0  # what follows is the next request's head

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_bytes is not None and not self.transport.is_closing():
            self._start_head_timer()  # the client's turn: its next head is due

    def _refuse_head(self) -> None:
        """hyper's answer to a head past its limits: 431, no body, and the connection closed."""
        self._stop_head_timer()
        lines = [b"HTTP/1.1 431 Request Header Fields Too Large\r\n"]
        lines += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        lines.append(b"content-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.write(b"".join(lines))
        self.transport.close()

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.head_read_timeout_s, self.transport.close)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def bounded_head_protocol(head_read_timeout_s: float) -> type[BoundedHeadProtocol]:
    """The protocol class uvicorn is given, with --header-read-timeout."""

    class Configured(BoundedHeadProtocol):
        pass

    Configured.head_read_timeout_s = head_read_timeout_s
    return Configured
