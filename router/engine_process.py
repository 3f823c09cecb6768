"""The engine's busy loop in its own process: receive requests, step, send token events.

It exits when told to, when its parent process is gone, or when a step raises past the executor's
containment (a router bug): the client then sees the process die and fails every pending request.
"""

from __future__ import annotations

import logging
import os

import zmq

from router.client_api import RequestRejectedError
from router.config import EngineConfig
from router.engine import EngineCore
from router.outputs import TokenEvent
from router.stats import EngineStats
from router.wire import (
    AbortRequest,
    AddRequest,
    Ready,
    Rejected,
    Shutdown,
    StartupFailed,
    StatsReport,
    StepOutputs,
    client_message_decoder,
    encoder,
)

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 100


def run_engine_process(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.setsockopt(zmq.RCVHWM, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(input_address)
    outbox.connect(output_address)
    try:
        core = EngineCore.from_config(config)
    except Exception as exc:  # noqa: BLE001 - reported to the client, which raises it
        logger.exception("engine startup failed")
        outbox.send(encoder.encode(StartupFailed(f"{type(exc).__name__}: {exc}")))
        return
    outbox.send(encoder.encode(Ready(core.info)))
    try:
        _serve(core, inbox, outbox, parent_pid)
    finally:
        outbox.close(linger=1000)
        inbox.close(linger=0)
        context.term()


def _serve(core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
    overlap = core.config.overlap_host_io
    if overlap is None:
        overlap = core.info.device.startswith("cuda")
    _EngineLoop(core, inbox, outbox, parent_pid, overlap).run()


class _EngineLoop:
    """Receive, step, send. With `overlap`, the I/O of a turn runs while the GPU computes a step.

    Step N's events are held back and sent from inside step N+1 (the executor's while_gpu_works
    hook, between launching the GPU work and waiting for it), where new client messages are read
    too. Held events are flushed at once when a step had no GPU work to hide behind, when the engine
    goes idle (nothing waits for input while holding events), before a StatsReport (which follows
    the events of the steps it counts) and when the loop stops. So every event leaves at most one
    step late, and the order on the wire is the order the scheduler produced the events in.
    """

    def __init__(
        self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int, overlap: bool
    ) -> None:
        self.core, self.inbox, self.outbox = core, inbox, outbox
        self.parent_pid = parent_pid
        self.overlap = overlap
        self.held: list[TokenEvent] = []  # events of the last step, not yet sent
        self.hook_ran = False  # this turn's step called while_gpu_works (so held events left)
        self.stopping = False

    def run(self) -> None:
        core = self.core
        if self.overlap:
            core.while_gpu_works = self.while_gpu_works
        while True:
            # Also read here when busy: a request that arrived after the last hook joins this step.
            self._receive(0 if core.has_unfinished() else IDLE_POLL_MS)
            if self.stopping:
                break
            if os.getppid() != self.parent_pid:
                logger.error("parent process is gone; engine exits")
                return
            self.hook_ran = False
            events, stats = core.run_once()
            self._emit(events, stats)
            if self.stopping:  # a Shutdown read by the hook
                break
        self._flush()

    def while_gpu_works(self) -> None:
        self.hook_ran = True
        self._flush()
        self._receive(0)

    def _emit(self, events: list[TokenEvent], stats: EngineStats | None) -> None:
        if not self.overlap:
            if events:
                self.outbox.send(encoder.encode(StepOutputs(events)))
        else:
            self.held += events
            if not self.hook_ran or stats is not None or not self.core.has_unfinished():
                self._flush()
        if stats is not None:
            self.outbox.send(encoder.encode(StatsReport(stats)))

    def _flush(self) -> None:
        if self.held:
            self.outbox.send(encoder.encode(StepOutputs(self.held)))
            self.held = []

    def _receive(self, timeout_ms: int) -> None:
        """Apply every client message that arrives within the timeout (none waited for after the first)."""
        while not self.stopping and self.inbox.poll(timeout_ms):
            timeout_ms = 0
            if not _handle(self.core, client_message_decoder.decode(self.inbox.recv()), self.outbox):
                self.stopping = True


def _handle(core: EngineCore, message, outbox: zmq.Socket) -> bool:
    """Apply one client message; False when the engine should stop."""
    if isinstance(message, AddRequest):
        try:
            core.add_request(message.request)
        except (RequestRejectedError, ValueError) as exc:
            outbox.send(encoder.encode(Rejected(message.request.request_id, str(exc))))
    elif isinstance(message, AbortRequest):
        core.abort(message.request_id)
    elif isinstance(message, Shutdown):
        return False
    return True
