"""AppState: what every route reaches through `request.app.state.tgi` (or `Depends(get_state)`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Self

from fastapi import Request

from tgi_compat.api.config import ServerConfig, ServingLimits
from tgi_compat.api.observability.metrics import ServerMetrics
from tgi_compat.api.observability.tracing import RequestTracer
from tgi_compat.api.protocol.errors import Model, parse_json_body
from tgi_compat.api.serving.images import VisionPrompts
from tgi_compat.api.serving.permits import PermitPool
from tgi_compat.api.serving.tokenization import TokenizerService
from tgi_compat.router.client_api import EngineClient

_NO_TRACER = RequestTracer()


@dataclass(slots=True)
class ModelInfo:
    model_id: str
    sha: str | None = None
    pipeline_tag: str | None = None  # None: unknown (local model), which TGI treats as text-generation


@dataclass(slots=True)
class AppState:
    config: ServerConfig
    limits: ServingLimits
    engine: EngineClient
    tokenizer: TokenizerService
    permits: PermitPool
    model: ModelInfo
    metrics: ServerMetrics  # TGI's and vLLM's families, fed by the requests and the engine's stats
    compute_type: str = "gpu+optimized"  # env COMPUTE_TYPE, x-compute-type header
    tracer: RequestTracer | None = None  # OTLP spans (--otlp-endpoint); None: tracing off
    vision: VisionPrompts | None = None  # a vision model's image prompts; None: `![](...)` stays text

    @classmethod
    def over_engine(
        cls, config: ServerConfig, engine: EngineClient, tokenizer: TokenizerService, **fields: Any
    ) -> AppState:
        """A server's state over `engine`: the limits it allows, and the permits and metrics they size."""
        limits = ServingLimits.resolve(config, engine.info.max_total_tokens)
        metrics = ServerMetrics(limits.max_input_tokens, limits.max_total_tokens, model_name=config.model_id)
        metrics.set_max_batch_total_tokens(engine.info.num_kv_slots)
        metrics.max_lora = engine.info.max_loras
        metrics.set_lora_count(len(engine.lora_adapters))
        return cls(
            config=config,
            limits=limits,
            engine=engine,
            tokenizer=tokenizer,
            permits=PermitPool(config.max_concurrent_requests),
            model=ModelInfo(config.model_id),
            metrics=metrics,
            **fields,
        )

    def request_span(self, name: str, request: Request, **attributes: object):
        """The route's root span (a no-op context without --otlp-endpoint)."""
        tracer = self.tracer or _NO_TRACER
        return tracer.request_span(name, request.headers, **attributes)

    @property
    def served_model_name(self) -> str:
        """`--served-model-name` when the config has it (ours), else the model id (TGI)."""
        return self.config.served_model_name or self.model.model_id

    def reported_cached_tokens(self, cached_tokens: int) -> int | None:
        """The `cached_tokens` that usage reports: only with --enable-prompt-tokens-details."""
        return cached_tokens if self.config.enable_prompt_tokens_details else None

    async def expand_images(self, inputs: str) -> str:
        """The text a prompt is tokenized as: a vision model's images as its image tokens (serving/images.py)."""
        return inputs if self.vision is None else (await self.vision.expand(inputs, for_engine=False))[0]

    def special_tokens(self, requested: bool = True) -> bool:
        """Whether a prompt's tokenizing adds special tokens: as requested, except for a vision model whose prompts
        never take them (PaliGemma's, whose text brings its own `<bos>`)."""
        return requested and (self.vision is None or self.vision.adds_special_tokens)

    @property
    def compat_return_full_text(self) -> bool:
        """POST / default: true for text-generation models and when the tag is unknown."""
        return self.model.pipeline_tag in (None, "text-generation")


def get_state(request: Request) -> AppState:
    return request.app.state.tgi


class Service:
    """What a route hands its parsed body to: built per request over the app's state (`of`)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    @classmethod
    def of(cls, request: Request) -> Self:
        return cls(get_state(request))

    @property
    def payload_limit(self) -> int:
        return self.state.config.payload_limit

    @classmethod
    async def with_body(
        cls,
        request: Request,
        body_type: type[Model],
        parse: Callable[[Request, type[Model], int], Awaitable[Model]] = parse_json_body,
    ) -> tuple[Self, Model]:
        """The service for `request`, and its JSON body read as `body_type` within the payload limit."""
        service = cls.of(request)
        return service, await parse(request, body_type, service.payload_limit)
