"""GET /, /health, /ping, /info, /metrics, /v1/models (docs/contract.md §8). None needs the API key."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tgi_compat.api.protocol.errors import unhealthy_response
from tgi_compat.api.protocol.tgi import ROUTER_NAME, TGI_VERSION, Info
from tgi_compat.api.serving.lora_adapters import adapter_cards
from tgi_compat.api.serving.state import get_state

logger = logging.getLogger(__name__)
router = APIRouter()


def _get(path: str, summary: str, include_in_schema: bool = True):
    """GET route that also answers HEAD, as axum's `get(...)` does (HEAD kept out of the docs)."""

    def register(endpoint):
        router.add_api_route(path, endpoint, methods=["GET"], summary=summary, include_in_schema=include_in_schema)
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
        return endpoint

    return register


HEALTH_TIMEOUT_SECONDS = 30.0  # an engine loop that answers no probe for this long is hung
METRICS_CONTENT_TYPE = "text/plain; charset=utf-8"


async def _health(request: Request) -> Response:
    state = get_state(request)
    try:
        healthy = await asyncio.wait_for(state.engine.check_health(), HEALTH_TIMEOUT_SECONDS)
    except Exception as error:  # a dead or hung engine is simply unhealthy
        logger.warning("health check failed: %s", error or type(error).__name__)
        healthy = False
    return Response(status_code=200) if healthy else unhealthy_response()


_get("/", "Health check method", include_in_schema=False)(_health)
_get("/health", "Health check method")(_health)
_get("/ping", "Health check method (SageMaker)")(_health)


@_get("/info", "Text Generation Inference endpoint info")
async def info(request: Request) -> JSONResponse:
    state = get_state(request)
    limits, config = state.limits, state.config
    body = Info(
        model_id=state.model.model_id,
        model_sha=state.model.sha,
        model_pipeline_tag=state.model.pipeline_tag,
        max_concurrent_requests=limits.max_concurrent_requests,
        max_best_of=limits.max_best_of,
        max_stop_sequences=limits.max_stop_sequences,
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        validation_workers=config.validation_workers,
        max_client_batch_size=limits.max_client_batch_size,
        router=ROUTER_NAME,
        version=TGI_VERSION,
        sha=None,
        docker_label=None,
    )
    return JSONResponse(body.to_dict())


@_get("/metrics", "Prometheus metrics scrape endpoint")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    content = state.metrics.render()
    return Response(content, media_type=METRICS_CONTENT_TYPE)


@_get("/v1/models", "Get model info")
async def models(request: Request) -> JSONResponse:
    state = get_state(request)
    model_id = state.served_model_name
    base = {"id": model_id, "object": "model", "created": 0, "owned_by": model_id}
    return JSONResponse({"object": "list", "data": [base, *adapter_cards(state)]})
