"""The engine's client interface, as the API layer sees it.

    api process                          engine process (or a thread, for tests)
    EngineClient.generate(req)  --ZMQ-->  EngineCore.step() loop  --ZMQ-->  TokenEvent stream

`generate` yields TokenEvents until one carries a finish_reason. Closing the iterator early (the
HTTP client went away) aborts the request; its KV slots are free after the next step.
If the engine dies, every pending iterator raises EngineDeadError at once.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import ClassVar

from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.stats import EngineStats


class EngineDeadError(RuntimeError):
    pass


class Refusal(enum.Enum):
    """Why the engine refused a request before admission. The engine holds no text: the API maps each
    reason and its values to TGI's message (tgi_compat/api/serving/validation.py)."""

    TEMPERATURE = "temperature"
    REPETITION_PENALTY = "repetition_penalty"
    FREQUENCY_PENALTY = "frequency_penalty"
    TOP_P = "top_p"
    TYPICAL_P = "typical_p"
    TOP_K = "top_k"
    TOP_N_TOKENS = "top_n_tokens"
    SEED = "seed"
    MAX_NEW_TOKENS = "max_new_tokens"
    EMPTY_PROMPT = "empty_prompt"
    LOGIT_BIAS_TOKEN = "logit_bias_token"  # values: (token id, vocab size)
    PROMPT_TOKEN = "prompt_token"  # values: (token id, vocab size)
    TOTAL_TOKENS = "total_tokens"  # values: (max total tokens, prompt tokens, max_new_tokens)
    KV_CAPACITY = "kv_capacity"  # values: (prompt tokens,): a pooling prompt larger than the KV cache
    UNKNOWN_ADAPTER = "unknown_adapter"  # values: (name, *loaded names)
    LORA_OFF = "lora_off"  # values: (name,)
    DUPLICATE_ID = "duplicate_id"  # values: (request id,)


class RequestRejectedError(ValueError):
    """The engine refused a request before admission: a `Refusal` and the values its message shows."""

    def __init__(self, reason: Refusal, *values: int | str) -> None:
        super().__init__(reason.value, *values)
        self.reason = reason
        self.values = values


class AdapterCallError(ValueError):
    """A LoRA adapter load or unload that changed nothing, with the reason."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found  # the adapter (unload) or its files (load) do not exist


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
    # a pooling model's task ("embed", "classify", "reward"; tgi_compat/router/pooling_engine.py): it generates nothing
    pooling_task: str | None = None
    labels: tuple[str, ...] = ()  # a classifier's label names, in the order of its scores
    max_loras: int = 0  # LoRA adapters in one step (--max-loras); 0: LoRA off
    lora_adapters: dict[str, str] = field(default_factory=dict)  # name -> source, loaded at startup


class EngineClient(ABC):
    info: EngineInfo
    # Called in the event loop with each periodic EngineStats (tgi_compat feeds its metrics).
    stats_listener: Callable[[EngineStats], None] | None = None
    latest_stats: EngineStats | None = None  # the last periodic report; None before the first
    can_restart: ClassVar[bool] = False  # whether restart() can replace the engine

    @property
    def is_dead(self) -> bool:
        """True once the engine is gone (its process exited): every pending request has failed."""
        return False

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """Closing it before the last event aborts the request."""

    def generate_batches(self, request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        """`generate`, each item holding every event that had arrived (clients that queue events
        hand them over in one wake-up); by default one event per item."""
        return _one_event_batches(self.generate(request))

    async def restart(self) -> None:
        """Kill the engine if it still runs, fail every pending request, start a fresh one
        (only where can_restart)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart its engine")

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Name -> source of the LoRA adapters loaded now."""
        return self.info.lora_adapters

    async def load_adapter(self, name: str, source: str, replace: bool = False) -> None:
        """Load a LoRA adapter while serving, with `replace` in place of the one of that name (AdapterCallError: the
        reason, nothing changed)."""
        raise AdapterCallError(f"{type(self).__name__} cannot load LoRA adapters")

    async def unload_adapter(self, name: str) -> None:
        """AdapterCallError(not_found=True) when it is not loaded."""
        raise AdapterCallError(f"{type(self).__name__} cannot unload LoRA adapters")

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def check_health(self) -> bool:
        """True when the engine is alive and making progress (never queued behind requests)."""

    @abstractmethod
    async def shutdown(self) -> None: ...


async def _one_event_batches(events: AsyncGenerator[TokenEvent, None]) -> AsyncGenerator[list[TokenEvent], None]:
    async with aclosing(events):
        async for event in events:
            yield [event]
