"""What a host loop (the engine process, the in-process client's thread) drives: a generating EngineCore
(tgi_compat/router/engine.py) or, for a pooling model, a PoolingEngineCore (tgi_compat/router/pooling_engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tgi_compat.router.client_api import EngineInfo
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.lora_calls import AdapterCalls
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.stats import EngineStats


class EngineLoop(Protocol):
    info: EngineInfo
    adapter_calls: AdapterCalls  # LoRA loads and unloads while serving (refused where LoRA is off)

    def add_request(self, params: GenerateRequest) -> None:
        """Validate (RequestRejectedError) and queue."""
        ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def run_once(self) -> tuple[list[TokenEvent], EngineStats | None]:
        """A step when there is work, and the stats report that is due."""
        ...

    def close(self) -> None: ...


def load_engine(config: EngineConfig, count_step: Callable[[], None] | None = None) -> EngineLoop:
    """Load the model the config names and build the engine that serves it: a pooling model's prefill-only
    engine, or the generating one."""
    from tgi_compat.router.engine import EngineCore
    from tgi_compat.router.model_loading import fit_to_runner, load_drafter, load_runner
    from tgi_compat.router.pooling_engine import PoolingEngineCore

    runner = load_runner(config, count_step=count_step)
    if runner.pooling_task is not None:
        return PoolingEngineCore(config, runner, runner.model_config)
    config = fit_to_runner(config, runner)
    drafter = load_drafter(config, runner)
    model = runner.model_config
    return EngineCore(config, runner, model, runner.lora, runner.image_encoder, drafter, runner.cross_attention)
