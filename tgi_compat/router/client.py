"""The engine loop in a spawned process (and its tensor-parallel ranks), reached over two ipc:// ZeroMQ
sockets; the request bookkeeping is tgi_compat/router/client_queueing.py's.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from multiprocessing.process import BaseProcess

import zmq
import zmq.asyncio

from tgi_compat.router import wire
from tgi_compat.router.client_api import EngineDeadError, EngineInfo, RequestRejectedError
from tgi_compat.router.client_queueing import QueueingClient
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine_process import run_engine_process
from tgi_compat.router.rank_heartbeat import BEAT_INTERVAL_S, HangWatch, RankHeartbeats, hang_timeout_s
from tgi_compat.router.tp_worker import run_tp_worker

logger = logging.getLogger(__name__)
ENGINE_EXIT_TIMEOUT_S = 5.0  # after Shutdown; then the engine process is killed


class ZmqEngineClient(QueueingClient):
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
        self._adapter_calls.adapters = dict(self.info.lora_adapters)  # a restarted engine: the startup ones
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
            self._sockets[1].send(wire.encoder.encode(wire.Shutdown()), flags=zmq.NOBLOCK)  # rank 0 releases the others
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
            self._sockets[1].send(wire.encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._mark_dead(f"cannot reach the engine: {exc}")

    async def _read_outputs(self, inbox) -> None:
        while True:
            message = wire.engine_message_decoder.decode(await inbox.recv())
            if isinstance(message, wire.StepOutputs):
                self._dispatch(message.events)
            elif isinstance(message, wire.StatsReport):
                self._on_stats(message.stats)
            elif isinstance(message, wire.Rejected):
                self._reject(message.request_id, RequestRejectedError(message.reason, *message.values))
            elif isinstance(message, wire.HealthReply):
                self._on_health_reply()
            elif isinstance(message, wire.AdapterReply):
                self._adapter_calls.on_reply(message)

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
            message = wire.engine_message_decoder.decode(await inbox.recv())
            if isinstance(message, wire.Ready):
                return message.info
            if isinstance(message, wire.StartupFailed):
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
