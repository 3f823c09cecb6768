"""SIGTERM handling: stop taking requests, let running ones finish, exit 0 (TGI's behaviour).

uvicorn already does the draining part: on SIGTERM/SIGINT it closes the listening socket, closes
idle keep-alive connections, lets busy ones finish their response (streams included) for up to
`timeout_graceful_shutdown` seconds, then cancels what is left. But after `serve()` returns it
re-raises the captured signal with the handler that was installed before it started; with
Python's default SIGTERM handler that kills the process (exit 143) before the caller can shut the
engine down. `GracefulShutdown.serve` installs a recording handler first, so the re-raised
signal only gets noted, the caller's cleanup runs, and the process exits 0.
sse-starlette, for its part, ends every EventSourceResponse the moment uvicorn starts shutting
down; `serve` turns that off so running streams finish too (the grace timeout still bounds them).

When the grace period runs out, `on_expired` (the engine's shutdown) fails every request still in
flight with TGI's error shape, so each handler answers and uvicorn's own cancellation, a few
seconds later, finds nothing left to cancel: the process exits within the grace period plus the
engine's exit, whatever was in flight.

    graceful = GracefulShutdown(config.graceful_termination_timeout, on_expired=engine.shutdown)
    server = uvicorn.Server(uvicorn.Config(app, ..., **graceful.uvicorn_options()))
    await graceful.serve(server)          # returns after the drain
    await engine.shutdown()               # then the engine
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger("tgi_compat.graceful")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _let_sse_streams_finish() -> None:
    try:
        from sse_starlette.sse import AppStatus
    except ImportError:
        return
    AppStatus.disable_automatic_graceful_drain()


EXPIRY_MARGIN_S = 3.0  # after on_expired, for the failed requests' answers to be written


class GracefulShutdown:
    def __init__(self, timeout_s: float = 90.0, on_expired: Callable[[], Awaitable[None]] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_expired = on_expired
        self.received: signal.Signals | None = None  # the first termination signal, if any

    def uvicorn_options(self) -> dict[str, Any]:  # keyword arguments of uvicorn.Config
        margin = EXPIRY_MARGIN_S if self.on_expired is not None else 0.0
        return {"timeout_graceful_shutdown": self.timeout_s + margin}

    async def _expire(self, server: uvicorn.Server, on_expired: Callable[[], Awaitable[None]]) -> None:
        while not server.should_exit:
            await asyncio.sleep(0.1)
        await asyncio.sleep(self.timeout_s)
        logger.warning("Grace period of %.0f s over: failing the requests still in flight", self.timeout_s)
        await on_expired()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    async def serve(self, server: uvicorn.Server) -> None:
        """Run `server` until a termination signal (or `should_exit`), drained."""
        _let_sse_streams_finish()
        expiry = asyncio.create_task(self._expire(server, self.on_expired)) if self.on_expired is not None else None
        try:
            await self._serve(server)
        finally:
            if expiry is not None:
                expiry.cancel()

    async def _serve(self, server: uvicorn.Server) -> None:
        if threading.current_thread() is not threading.main_thread():
            await server.serve()  # signals are only delivered to the main thread
            return
        previous = {sig: signal.signal(sig, self._record) for sig in _SIGNALS}
        try:
            await server.serve()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.received is not None:
            logger.info(
                "Received %s: in-flight requests drained (limit %.0f s), shutting down",
                self.received.name,
                self.timeout_s,
            )
