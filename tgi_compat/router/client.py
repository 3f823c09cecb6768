"""EngineClient implementations: the engine in its own process (ZeroMQ), or in a thread (tests).

Both share the request bookkeeping in `_QueueingClient`: one asyncio.Queue per pending request,
fed by whatever brings events back. `generate()` validates before anything is sent, yields events
until one finishes the request, and aborts the request if the caller stops iterating early. When
the engine dies, every queue receives EngineDeadError at once; nobody waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Callable
from multiprocessing.process import BaseProcess

import zmq
import zmq.asyncio

from tgi_compat.router.client_api import EngineClient, EngineDeadError, EngineInfo, Refusal, RequestRejectedError
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.engine_process import run_engine_process
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.rank_heartbeat import BEAT_INTERVAL_S, HangWatch, RankHeartbeats, hang_timeout_s
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.stats import EngineStats
from tgi_compat.router.tp_worker import run_tp_worker
from tgi_compat.router.wire import (
    AbortRequest,
    AddRequest,
    HealthProbe,
    HealthReply,
    Ready,
    Rejected,
    Shutdown,
    StartupFailed,
    StatsReport,
    StepOutputs,
    encoder,
    engine_message_decoder,
)

logger = logging.getLogger(__name__)
_health_ids = itertools.count()
ENGINE_EXIT_TIMEOUT_S = 5.0  # after Shutdown; then the engine process is killed
PROGRESS_WINDOW_S = 10.0  # token events this recent show a live engine without probing it


class _RequestEvents:
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


class _QueueingClient(EngineClient):
    def __init__(self) -> None:
        self._pending: dict[str, _RequestEvents] = {}
        self._dead_reason: str | None = None
        # Called in the event loop with each periodic EngineStats (tgi_compat feeds its metrics).
        self.stats_listener: Callable[[EngineStats], None] | None = None
        self.latest_stats: EngineStats | None = None
        self._last_progress = float("-inf")  # monotonic time of the last token events or probe reply
        self._probe: asyncio.Future | None = None  # the health probe in flight

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
        events = _RequestEvents()
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

    async def check_health(self, timeout: float = 60.0) -> bool:
        """Alive and making progress: token events within PROGRESS_WINDOW_S prove it at once (TGI
        answers from recent generations too); otherwise a probe that the engine loop answers
        between two steps, so it never waits behind requests in admission."""
        if self._dead_reason is not None:
            return False
        if time.monotonic() - self._last_progress < PROGRESS_WINDOW_S:
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
        if self._probe is not None and not self._probe.done():
            self._probe.set_exception(EngineDeadError(reason))
            self._probe.exception()  # retrieved: nobody may be waiting for it


class ZmqEngineClient(_QueueingClient):
    """The engine loop in a spawned process, reached over two ipc:// ZeroMQ sockets."""

    can_restart = True

    _process: BaseProcess
    # context, outbox, inbox, dir; None once closed
    _sockets: tuple[zmq.asyncio.Context, zmq.asyncio.Socket, zmq.asyncio.Socket, str] | None

    def __init__(self, config: EngineConfig, startup_timeout: float) -> None:
        super().__init__()  # info, _process and _sockets come with _launch
        self.config = config
        self.startup_timeout = startup_timeout
        self._workers: list[BaseProcess] = []  # tensor-parallel ranks 1..N-1 (--num-shard N)
        self._sockets = None
        self._reader: asyncio.Task | None = None
        self._hang_watch: asyncio.Task | None = None  # --num-shard > 1: notices a rank that hangs

    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout: float = 900.0) -> ZmqEngineClient:
        client = cls(config, startup_timeout)
        await client._launch()
        return client

    async def restart(self) -> None:
        """Kill the engine if it still runs, fail every pending request, start a fresh one."""
        await self._stop(reason="engine is restarting")
        await self._launch()

    async def shutdown(self) -> None:
        await self._stop(reason="engine was shut down")

    async def _launch(self) -> None:
        socket_dir = tempfile.mkdtemp(prefix="tgi-engine-")
        input_address, output_address = f"ipc://{socket_dir}/input", f"ipc://{socket_dir}/output"
        context = zmq.asyncio.Context()
        outbox, inbox = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        outbox.setsockopt(zmq.SNDHWM, 0)  # never drop or refuse a request because of a queue limit
        inbox.setsockopt(zmq.RCVHWM, 0)
        outbox.bind(input_address)
        inbox.bind(output_address)
        self._sockets = (context, outbox, inbox, socket_dir)
        spawn = multiprocessing.get_context("spawn")
        heartbeats = RankHeartbeats(self.config.num_shard) if self.config.num_shard > 1 else None
        self._process = spawn.Process(
            target=run_engine_process,
            args=(self.config, input_address, output_address, os.getpid(), heartbeats),
            name="engine-core",
            daemon=True,
        )
        self._workers = [
            spawn.Process(
                target=run_tp_worker,
                args=(self.config, rank, os.getpid(), heartbeats),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, self.config.num_shard)
        ]
        for process in (self._process, *self._workers):
            process.start()
        try:
            self.info = await asyncio.wait_for(_await_ready(inbox, self._process, self._workers), self.startup_timeout)
        except BaseException:
            for process in (self._process, *self._workers):
                process.kill()
            _close(*self._sockets)
            raise
        self._dead_reason = None
        self._reader = asyncio.create_task(self._read_outputs(inbox))
        loop = asyncio.get_running_loop()
        loop.add_reader(self._process.sentinel, self._on_process_exit, self._process)
        for worker in self._workers:  # a rank that dies takes the engine with it
            loop.add_reader(worker.sentinel, self._on_process_exit, worker)
        if heartbeats is not None:  # and so does one that hangs
            self._hang_watch = asyncio.create_task(self._watch_heartbeats(heartbeats))

    async def _stop(self, reason: str) -> None:
        """Fail what is pending now, ask the engine to exit, kill it if it has not within
        ENGINE_EXIT_TIMEOUT_S: a busy or hung engine never outlives the server."""
        if self._sockets is None:
            return  # already stopped
        loop = asyncio.get_running_loop()
        process = self._process
        for each in (process, *self._workers):
            loop.remove_reader(each.sentinel)  # a requested exit is not a death
        was_dead = self._dead_reason is not None
        self._mark_dead(reason, is_error=False)
        started = time.monotonic()
        everyone = (process, *self._workers)
        if process.is_alive() and not was_dead:  # after a death the other ranks may be stuck: no wait
            self._sockets[1].send(encoder.encode(Shutdown()), flags=zmq.NOBLOCK)  # rank 0 releases the others
            while any(each.is_alive() for each in everyone) and time.monotonic() - started < ENGINE_EXIT_TIMEOUT_S:
                await asyncio.sleep(0.05)
        for each in everyone:
            if each.is_alive():
                if was_dead:
                    logger.warning("killing %s: the engine is dead", each.name)
                else:
                    logger.warning("%s did not exit within %.0f s; killing it", each.name, ENGINE_EXIT_TIMEOUT_S)
                each.kill()
            each.join(5)  # gone or killed: returns at once
        logger.info("engine stopped in %.1f s", time.monotonic() - started)
        if self._reader is not None:
            self._reader.cancel()
        if self._hang_watch is not None:
            self._hang_watch.cancel()
        _close(*self._sockets)
        self._sockets = None

    def _submit(self, message) -> None:
        if self._sockets is None:
            self._mark_dead("the engine is stopped")
            return
        try:
            self._sockets[1].send(encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._mark_dead(f"cannot reach the engine: {exc}")

    async def _read_outputs(self, inbox) -> None:
        while True:
            message = engine_message_decoder.decode(await inbox.recv())
            if isinstance(message, StepOutputs):
                self._dispatch(message.events)
            elif isinstance(message, StatsReport):
                self._on_stats(message.stats)
            elif isinstance(message, Rejected):
                self._reject(message.request_id, RequestRejectedError(message.reason, *message.values))
            elif isinstance(message, HealthReply):
                self._on_health_reply()

    async def _watch_heartbeats(self, heartbeats: RankHeartbeats) -> None:
        watch = HangWatch(heartbeats, hang_timeout_s(), time.monotonic())
        while not self.is_dead:
            await asyncio.sleep(BEAT_INTERVAL_S)
            if (hung := watch.check(time.monotonic())) is not None:
                self._mark_dead(hung)

    def _on_process_exit(self, process) -> None:
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join(timeout=1)
        what = "engine process" if process is self._process else f"tensor-parallel {process.name} process"
        self._mark_dead(f"{what} exited with code {process.exitcode}")
        if self._reader is not None:
            self._reader.cancel()


async def _await_ready(inbox, process, workers) -> EngineInfo:
    while True:
        if await inbox.poll(200):
            message = engine_message_decoder.decode(await inbox.recv())
            if isinstance(message, Ready):
                return message.info
            if isinstance(message, StartupFailed):
                raise EngineDeadError(f"engine failed to start: {message.error}")
        elif not process.is_alive():
            raise EngineDeadError(f"engine process exited during startup with code {process.exitcode}")
        elif dead := [w for w in workers if not w.is_alive()]:
            raise EngineDeadError(f"tensor-parallel {dead[0].name} exited during startup with code {dead[0].exitcode}")


def _close(context, outbox, inbox, socket_dir: str) -> None:
    outbox.close(linger=0)
    inbox.close(linger=0)
    context.term()
    shutil.rmtree(socket_dir, ignore_errors=True)


class InProcessEngineClient(_QueueingClient):
    """The same engine loop in a thread of this process: for tests and offline use."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.info = core.info
        self.core = core
        self._loop = asyncio.get_running_loop()
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, config: EngineConfig) -> InProcessEngineClient:
        if config.num_shard > 1:  # the other ranks are processes that only ZmqEngineClient starts
            raise ValueError("tensor parallelism (num_shard > 1) needs the engine in its own process")
        core = await asyncio.get_running_loop().run_in_executor(None, EngineCore.from_config, config)
        return cls(core)

    def _submit(self, message) -> None:
        self._inbox.put(message)

    def _run(self) -> None:
        try:
            while self._drain_inbox():
                events, stats = self.core.run_once()
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
            else:
                try:
                    self.core.add_request(message.request)
                except RequestRejectedError as refused:
                    self._loop.call_soon_threadsafe(self._reject, message.request.request_id, refused)

    async def shutdown(self) -> None:
        self._submit(Shutdown())
        await self._loop.run_in_executor(None, self._thread.join, 10)
        self._mark_dead("engine was shut down", is_error=False)
