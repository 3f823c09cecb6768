"""The engine's client interface, as the API layer sees it.

    api process                          engine process (or a thread, for tests)
    EngineClient.generate(req)  --ZMQ-->  EngineCore.step() loop  --ZMQ-->  TokenEvent stream

`generate` yields TokenEvents until one carries a finish_reason. Closing the iterator early (the
HTTP client went away) aborts the request; its KV slots are free after the next step.
If the engine dies, every pending iterator raises EngineDeadError at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router.outputs import TokenEvent
from router.request import GenerateRequest


class EngineDeadError(RuntimeError):
    pass


class RequestRejectedError(ValueError):
    """Raised by generate() before admission (bad sampling params, prompt too long)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_id: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_position_embeddings: int
    num_kv_slots: int  # KV capacity in tokens
    max_total_tokens: int  # per-request cap the engine enforces
    eos_token_ids: tuple[int, ...]


class EngineClient(ABC):
    info: EngineInfo

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def check_health(self) -> bool:
        """True when the engine is alive and making progress (never queued behind requests)."""

    @abstractmethod
    async def shutdown(self) -> None: ...
