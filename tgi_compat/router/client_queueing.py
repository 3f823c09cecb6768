"""The request bookkeeping both EngineClients share: one `RequestEvents` per pending request, fed by
whatever brings events back (a socket reader, an engine thread).

`generate()` yields events until one finishes the request, and aborts the request if the caller stops
iterating early. When the engine dies, every pending request receives EngineDeadError at once; nobody
waits forever. A request the engine refused raises its RequestRejectedError.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable

from tgi_compat.router.client_api import EngineClient, EngineDeadError, Refusal, RequestRejectedError
from tgi_compat.router.lora_client import PendingAdapterCalls
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.stats import EngineStats
from tgi_compat.router.wire import AbortRequest, AdapterCall, AddRequest, HealthProbe, LoadAdapter, UnloadAdapter

logger = logging.getLogger(__name__)
_health_ids = itertools.count()
PROGRESS_WINDOW_S = 10.0  # token events this recent show a live engine without probing it
# ... or this many of the slowest recent step: an engine whose steps are slow (a loaded CPU, a huge batch) is
# busy, not hung, and a probe would wait for the step to end (a health monitor might even restart it).
SLOW_STEPS_IN_WINDOW = 3.0


class RequestEvents:
    """One request's undelivered events: a list and at most one waiting consumer.

    Lighter than asyncio.Queue (no size limit, no getter list): `put` runs once per token for
    every stream, `take_all` hands over everything that arrived since the last call.
    """

    __slots__ = ("_events", "_error", "_waiter")

    def __init__(self) -> None:
        self._events: list[TokenEvent] = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, event: TokenEvent) -> None:
        self._events.append(event)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Events already received are still delivered; the error is raised after them."""
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take_all(self) -> list[TokenEvent]:
        while not self._events:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        return events


class QueueingClient(EngineClient):
    def __init__(self) -> None:
        self._pending: dict[str, RequestEvents] = {}
        self._dead_reason: str | None = None
        # Called in the event loop with each periodic EngineStats (tgi_compat feeds its metrics).
        self.stats_listener: Callable[[EngineStats], None] | None = None
        self.latest_stats: EngineStats | None = None
        self._last_progress = float("-inf")  # monotonic time of the last token events or probe reply
        self._progress_window = PROGRESS_WINDOW_S  # widened while the engine reports slow steps
        self._probe: asyncio.Future | None = None  # the health probe in flight
        self._adapter_calls = PendingAdapterCalls({})  # LoRA loads and unloads in flight

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        async with contextlib.aclosing(self.generate_batches(request)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def generate_batches(self, request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        """`generate`, but each item is every event that had arrived for the request: one await
        per batch instead of per token, so a consumer that falls behind catches up in bulk."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if request.request_id in self._pending:
            raise RequestRejectedError(Refusal.DUPLICATE_ID, request.request_id)
        events = RequestEvents()
        self._pending[request.request_id] = events
        is_finished = False
        try:
            self._submit(AddRequest(request))
            while not is_finished:
                try:
                    batch = await events.take_all()
                except (EngineDeadError, RequestRejectedError):
                    is_finished = True  # the engine holds nothing of this request to abort
                    raise
                for position, event in enumerate(batch):
                    if event.finish_reason is not None:  # the engine sends nothing after the end
                        is_finished = True
                        batch = batch[: position + 1]
                        break
                yield batch
        finally:
            self._pending.pop(request.request_id, None)
            if not is_finished and self._dead_reason is None:
                self._submit(AbortRequest(request.request_id))

    async def abort(self, request_id: str) -> None:
        if self._dead_reason is None:
            self._submit(AbortRequest(request_id))

    @property
    def lora_adapters(self) -> dict[str, str]:
        return self._adapter_calls.adapters

    async def load_adapter(self, name: str, source: str, replace: bool = False) -> None:
        await self._adapter_call(LoadAdapter(PendingAdapterCalls.next_id(), name, source, replace))

    async def unload_adapter(self, name: str) -> None:
        await self._adapter_call(UnloadAdapter(PendingAdapterCalls.next_id(), name))

    async def _adapter_call(self, call: AdapterCall) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        await self._adapter_calls.call(call, self._submit)

    async def check_health(self, timeout: float = 60.0) -> bool:
        """Alive and making progress: token events within the progress window (PROGRESS_WINDOW_S, or
        SLOW_STEPS_IN_WINDOW of the slowest step last reported) prove it at once (TGI answers from recent
        generations too); otherwise a probe that the engine loop answers between two steps, so it never
        waits behind requests in admission."""
        if self._dead_reason is not None:
            return False
        if time.monotonic() - self._last_progress < self._progress_window:
            return True
        if self._probe is None or self._probe.done():  # concurrent checks share one probe
            self._probe = asyncio.get_running_loop().create_future()
            self._submit(HealthProbe(next(_health_ids)))
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), timeout)
        except (TimeoutError, EngineDeadError):
            return False
        return True

    # ---- called by subclasses -----------------------------------------------------------
    def _submit(self, message) -> None:
        raise NotImplementedError

    def _dispatch(self, events: list[TokenEvent]) -> None:
        self._last_progress = time.monotonic()
        pending = self._pending
        for event in events:
            if (request_events := pending.get(event.request_id)) is not None:
                request_events.put(event)

    def _on_stats(self, stats: EngineStats) -> None:
        self.latest_stats = stats
        if stats.steps:
            slowest = max(step.total_s for step in stats.steps)
            self._progress_window = max(PROGRESS_WINDOW_S, SLOW_STEPS_IN_WINDOW * slowest)
        if self.stats_listener is not None:
            self.stats_listener(stats)

    def _on_health_reply(self) -> None:
        self._last_progress = time.monotonic()
        if self._probe is not None and not self._probe.done():
            self._probe.set_result(None)

    def _reject(self, request_id: str, refused: RequestRejectedError) -> None:
        if (request_events := self._pending.get(request_id)) is not None:
            request_events.fail(refused)

    def _mark_dead(self, reason: str, is_error: bool = True) -> None:
        if self._dead_reason is not None:
            return
        if is_error:
            logger.error("engine is dead: %s", reason)
        self._dead_reason = reason
        for request_events in self._pending.values():
            request_events.fail(EngineDeadError(reason))
        self._adapter_calls.fail(EngineDeadError(reason))
        if self._probe is not None and not self._probe.done():
            self._probe.set_exception(EngineDeadError(reason))
            self._probe.exception()  # retrieved: nobody may be waiting for it
