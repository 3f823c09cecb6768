"""The engine's busy loop in its own process: receive requests, step, send token events.

It exits when told to, when its parent process is gone, or when a step raises past the executor's
containment (a router bug): the client then sees the process die and fails every pending request.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import zmq

from tgi_compat.router.client_api import RequestRejectedError
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine_loop import EngineLoop, load_engine
from tgi_compat.router.process_exit import exit_process
from tgi_compat.router.rank_heartbeat import RankHeartbeats
from tgi_compat.router.stall_sampler import stall_sampler_from_env
from tgi_compat.router.wire import (
    AbortRequest,
    AddRequest,
    HealthProbe,
    HealthReply,
    LoadAdapter,
    Ready,
    Rejected,
    Shutdown,
    StartupFailed,
    StatsReport,
    StepOutputs,
    UnloadAdapter,
    client_message_decoder,
    encoder,
)

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 100


def run_engine_process(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int,
    heartbeats: RankHeartbeats | None = None,  # tensor-parallel rank 0's beat (--num-shard > 1)
) -> None:
    count_step = None
    if heartbeats is not None:
        heartbeats.start_beating(0)
        count_step = heartbeats.step_counter(0)
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.setsockopt(zmq.RCVHWM, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(input_address)
    outbox.connect(output_address)
    try:
        core = load_engine(config, count_step)
    except Exception as exc:  # reported to the client, which raises it
        logger.exception("engine startup failed")
        outbox.send(encoder.encode(StartupFailed(f"{type(exc).__name__}: {exc}")))
        return
    outbox.send(encoder.encode(Ready(core.info)))
    freeze_startup_heap()
    try:
        _serve(core, inbox, outbox, parent_pid)
    finally:
        core.close()
        outbox.close(linger=1000)
        inbox.close(linger=0)
        context.term()
    exit_process(0)  # a clean stop; an exception above leaves through the interpreter with its traceback


def freeze_startup_heap() -> None:
    """Move everything start-up allocated out of the collector's reach (the API process: transformers,
    torch, the tokenizer, ~400k objects; the engine process: torch, the model, ~190k on CPU). Serving
    allocates fast, so full collections come, and each one walked that whole heap (~0.1-0.2 s in the
    API process; 86 ms for the engine process on a loaded 2-core CPU, a stall of the step loop, while
    the GPU idles) for garbage that never appears there."""
    gc.collect()
    gc.freeze()


def _serve(core: EngineLoop, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
    """Receive, step, send. With overlap scheduling a step returns while the GPU runs the step it
    launched, so the sends and receives of a turn are hidden behind the GPU as well."""
    stalls = stall_sampler_from_env()
    while True:
        # Also read when busy: a request that arrived during the last step joins the next one.
        if not _receive(core, inbox, outbox, 0 if core.has_unfinished() else IDLE_POLL_MS):
            return
        if os.getppid() != parent_pid:
            logger.error("parent process is gone; engine exits")
            return
        with stalls.turn() if stalls is not None else contextlib.nullcontext():
            events, stats = core.run_once()
            replies = core.adapter_calls.take_replies()  # loads read meanwhile, installed between two steps
        for reply in replies:
            outbox.send(encoder.encode(reply))
        if events:
            outbox.send(encoder.encode(StepOutputs(events)))
        if stats is not None:
            outbox.send(encoder.encode(StatsReport(stats)))


def _receive(core: EngineLoop, inbox: zmq.Socket, outbox: zmq.Socket, timeout_ms: int) -> bool:
    """Apply every client message that arrives within the timeout (none waited for after the
    first); False when the engine should stop."""
    while inbox.poll(timeout_ms):
        timeout_ms = 0
        if not _handle(core, client_message_decoder.decode(inbox.recv()), outbox):
            return False
    return True


def _handle(core: EngineLoop, message, outbox: zmq.Socket) -> bool:
    """Apply one client message; False when the engine should stop."""
    if isinstance(message, AddRequest):
        try:
            core.add_request(message.request)
        except RequestRejectedError as refused:
            outbox.send(encoder.encode(Rejected(message.request.request_id, refused.reason, refused.values)))
    elif isinstance(message, AbortRequest):
        core.abort(message.request_id)
    elif isinstance(message, HealthProbe):
        outbox.send(encoder.encode(HealthReply(message.probe_id)))
    elif isinstance(message, LoadAdapter | UnloadAdapter):
        if (reply := core.adapter_calls.submit(message)) is not None:
            outbox.send(encoder.encode(reply))
    elif isinstance(message, Shutdown):
        return False
    return True
