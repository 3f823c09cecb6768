"""Abandoned requests are dropped: when a POST's client leaves before its response is complete, its
handler is cancelled, and the cancellation closes the engine request (its KV slots free at the
next step), streaming or not, on every route.

One ASGI middleware instead of a check in each route. After the handler has read the whole body,
a watcher waits on the server's `receive()` for `http.disconnect` (uvicorn delivers it the moment
the connection closes) and cancels the handler task; the handler's own `receive()` calls (e.g.
sse-starlette's disconnect listener) are answered from the watcher's state. TGI drops such a
request at its next batch step; vLLM aborts a non-streaming request the same way.

A client leaving is routine, not an error: it costs one debug line, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("tgi_compat.api.serving.disconnect")

_DISCONNECT: Message = {"type": "http.disconnect"}


class _Exchange:
    """One request's receive/send as the handler sees them, and what the watcher saw."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive, self._send = receive, send
        self.body_read = asyncio.Event()
        self.client_left = asyncio.Event()
        self.response_done = False

    async def receive(self) -> Message:
        if self.body_read.is_set():  # only the watcher reads the socket from now on
            await self.client_left.wait()
            return _DISCONNECT
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.client_left.set()
        elif not message.get("more_body", False):
            self.body_read.set()
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.response_done = True
        await self._send(message)

    async def watch(self) -> None:
        """Return when the client leaves before the response is complete."""
        await self.body_read.wait()
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.client_left.set()
        if self.response_done:
            await asyncio.Event().wait()  # a normal end of the exchange: never report it


class AbortOnDisconnect:
    """ASGI middleware: cancel a POST handler whose client has left (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send)
        handler = asyncio.ensure_future(self._handle(scope, exchange))
        watcher = asyncio.ensure_future(exchange.watch())
        try:
            await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not handler.done():
                logger.debug("client left %s before its response was complete; request dropped", scope["path"])
                handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        finally:
            handler.cancel()  # only when this middleware itself is cancelled (server shutdown)
            watcher.cancel()
        if not handler.cancelled() and (error := handler.exception()) is not None:
            raise error

    async def _handle(self, scope: Scope, exchange: _Exchange) -> None:
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except ClientDisconnect:  # left while the body was being read
            logger.debug("client left %s while sending its body", scope["path"])
