"""Messages between the API process and the engine process (msgspec msgpack over ZeroMQ).

    client PUSH --(AddRequest | AbortRequest | HealthProbe | LoadAdapter | UnloadAdapter | Shutdown)--> engine PULL
    client PULL <--(Ready | StartupFailed | Rejected | StepOutputs | StatsReport | HealthReply | AdapterReply)-- engine PUSH

The client binds both ipc:// sockets in its own temporary directory and the engine connects, so
no port is ever hard-coded and a dead engine leaves nothing behind but that directory.
"""

from __future__ import annotations

import msgspec

from tgi_compat.router.client_api import EngineInfo, Refusal
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.stats import EngineStats


class AddRequest(msgspec.Struct, tag=True):
    request: GenerateRequest


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class HealthProbe(msgspec.Struct, tag=True):
    """Answered by the engine loop between two steps, never queued behind requests."""

    probe_id: int


class HealthReply(msgspec.Struct, tag=True):
    probe_id: int


class LoadAdapter(msgspec.Struct, tag=True):
    """Load a LoRA adapter while serving (vLLM's /v1/load_lora_adapter); answered by an AdapterReply."""

    call_id: int
    name: str
    source: str  # a folder or a hub id
    replace: bool = False  # in place of the adapter of that name, if one is loaded (vLLM's load_inplace)


class UnloadAdapter(msgspec.Struct, tag=True):
    call_id: int
    name: str


class AdapterReply(msgspec.Struct, tag=True):
    call_id: int
    adapters: dict[str, str]  # name -> source of every adapter loaded once the call is done
    error: str | None = None  # why nothing changed
    not_found: bool = False  # the adapter (unload) or its files (load) do not exist


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo


class StartupFailed(msgspec.Struct, tag=True):
    error: str


class Rejected(msgspec.Struct, tag=True):
    request_id: str
    reason: Refusal
    values: tuple[int | str, ...]


class StepOutputs(msgspec.Struct, tag=True, gc=False):
    events: list[TokenEvent]


class StatsReport(msgspec.Struct, tag=True):
    stats: EngineStats


AdapterCall = LoadAdapter | UnloadAdapter
ClientMessage = AddRequest | AbortRequest | HealthProbe | LoadAdapter | UnloadAdapter | Shutdown
EngineMessage = Ready | StartupFailed | Rejected | StepOutputs | StatsReport | HealthReply | AdapterReply

encoder = msgspec.msgpack.Encoder()
client_message_decoder = msgspec.msgpack.Decoder(ClientMessage)
engine_message_decoder = msgspec.msgpack.Decoder(EngineMessage)
