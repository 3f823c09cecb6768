"""POST /v1/embeddings, /pooling, /classify (vLLM's pooling routes) and /get_score (LightLLM's reward route):
parse, then the PoolingService (tgi_compat/api/serving/pooling_service.py) answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.answers import JsonAnswer
from tgi_compat.api.protocol.pooling import ClassificationRequest, EmbeddingRequest, PoolingRequest, ScoreRequest
from tgi_compat.api.routes.auth import require_api_key
from tgi_compat.api.serving.pooling_service import PoolingService

router = APIRouter(dependencies=[Depends(require_api_key)])
Body = TypeVar("Body", EmbeddingRequest, PoolingRequest, ClassificationRequest, ScoreRequest)


def _post(
    path: str,
    summary: str,
    body_type: type[Body],
    answer: Callable[[PoolingService, Body], Awaitable[JsonAnswer]],
) -> None:
    """One route: the body read as `body_type`, then `answer` answers it."""

    async def endpoint(request: Request) -> Response:
        service, body = await PoolingService.with_body(request, body_type)
        return (await answer(service, body)).response()

    name = path.rsplit("/", 1)[-1]  # the route name (in its OpenAPI operation id) FastAPI gave the old functions
    router.add_api_route(path, endpoint, methods=["POST"], name=name, summary=summary)


_post("/v1/embeddings", "Embed prompts (an embedding model)", EmbeddingRequest, PoolingService.embeddings)
_post("/pooling", "The pooled output of prompts (any pooling model)", PoolingRequest, PoolingService.pooling)
_post("/classify", "Classify prompts (a sequence-classification model)", ClassificationRequest, PoolingService.classify)
_post("/get_score", "Score a conversation (a reward model)", ScoreRequest, PoolingService.score)
