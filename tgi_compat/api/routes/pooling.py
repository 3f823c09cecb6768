"""POST /v1/embeddings, /pooling, /classify (vLLM's pooling routes) and /get_score (LightLLM's reward route):
parse, then the PoolingService (tgi_compat/api/serving/pooling_service.py) answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.answers import JsonAnswer
from tgi_compat.api.protocol.errors import parse_json_body
from tgi_compat.api.protocol.pooling import ClassificationRequest, EmbeddingRequest, PoolingRequest, ScoreRequest
from tgi_compat.api.routes.auth import require_api_key
from tgi_compat.api.serving.pooling_service import PoolingService

router = APIRouter(dependencies=[Depends(require_api_key)])
Body = TypeVar("Body", EmbeddingRequest, PoolingRequest, ClassificationRequest, ScoreRequest)


async def _answer(
    request: Request, body_type: type[Body], answer: Callable[[PoolingService, Body], Awaitable[JsonAnswer]]
) -> Response:
    service = PoolingService.of(request)
    body = await parse_json_body(request, body_type, service.payload_limit)
    return (await answer(service, body)).response()


@router.post("/v1/embeddings", summary="Embed prompts (an embedding model)")
async def embeddings(request: Request) -> Response:
    return await _answer(request, EmbeddingRequest, PoolingService.embeddings)


@router.post("/pooling", summary="The pooled output of prompts (any pooling model)")
async def pooling(request: Request) -> Response:
    return await _answer(request, PoolingRequest, PoolingService.pooling)


@router.post("/classify", summary="Classify prompts (a sequence-classification model)")
async def classify(request: Request) -> Response:
    return await _answer(request, ClassificationRequest, PoolingService.classify)


@router.post("/get_score", summary="Score a conversation (a reward model)")
async def get_score(request: Request) -> Response:
    return await _answer(request, ScoreRequest, PoolingService.score)
