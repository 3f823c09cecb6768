"""The engine loop in a thread of this process, behind the same EngineClient: for tests and offline use."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from tgi_compat.router.client_api import RequestRejectedError
from tgi_compat.router.client_queueing import QueueingClient
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine_loop import EngineLoop, load_engine
from tgi_compat.router.wire import AbortRequest, HealthProbe, LoadAdapter, Shutdown, UnloadAdapter

logger = logging.getLogger(__name__)


class InProcessEngineClient(QueueingClient):
    """The same engine loop in a thread of this process: for tests and offline use."""

    def __init__(self, core: EngineLoop) -> None:
        super().__init__()
        self.info = core.info
        self._adapter_calls.adapters = dict(core.info.lora_adapters)
        self.core = core
        self._loop = asyncio.get_running_loop()
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, config: EngineConfig) -> InProcessEngineClient:
        if config.num_shard > 1:  # the other ranks are processes that only ZmqEngineClient starts
            raise ValueError("tensor parallelism (num_shard > 1) needs the engine in its own process")
        core = await asyncio.get_running_loop().run_in_executor(None, load_engine, config)
        return cls(core)

    def _submit(self, message) -> None:
        self._inbox.put(message)

    def _run(self) -> None:
        try:
            while self._drain_inbox():
                events, stats = self.core.run_once()
                for reply in self.core.adapter_calls.take_replies():
                    self._loop.call_soon_threadsafe(self._adapter_calls.on_reply, reply)
                if events:
                    self._loop.call_soon_threadsafe(self._dispatch, events)
                if stats is not None:
                    self._loop.call_soon_threadsafe(self._on_stats, stats)
        except Exception as exc:  # the loop died: every pending request must learn it
            logger.exception("engine thread died")
            self._loop.call_soon_threadsafe(self._mark_dead, f"engine thread died: {type(exc).__name__}: {exc}")

    def _drain_inbox(self) -> bool:
        block = not self.core.has_unfinished()
        while True:
            try:
                message = self._inbox.get(block=block, timeout=0.1 if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(message, Shutdown):
                return False
            if isinstance(message, AbortRequest):
                self.core.abort(message.request_id)
            elif isinstance(message, HealthProbe):
                self._loop.call_soon_threadsafe(self._on_health_reply)
            elif isinstance(message, LoadAdapter | UnloadAdapter):
                if (reply := self.core.adapter_calls.submit(message)) is not None:
                    self._loop.call_soon_threadsafe(self._adapter_calls.on_reply, reply)
            else:
                try:
                    self.core.add_request(message.request)
                except RequestRejectedError as refused:
                    self._loop.call_soon_threadsafe(self._reject, message.request.request_id, refused)

    async def shutdown(self) -> None:
        self._submit(Shutdown())
        await self._loop.run_in_executor(None, self._thread.join, 10)
        self._mark_dead("engine was shut down", is_error=False)
