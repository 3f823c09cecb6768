"""POST /v1/embeddings, /pooling, /classify (vLLM's pooling routes) and /get_score (LightLLM's reward route):
parse, then the PoolingService (tgi_compat/api/serving/pooling_service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.errors import parse_json_body
from tgi_compat.api.protocol.pooling import ClassificationRequest, EmbeddingRequest, PoolingRequest, ScoreRequest
from tgi_compat.api.routes.auth import require_api_key
from tgi_compat.api.serving.pooling_service import PoolingService

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/embeddings", summary="Embed prompts (an embedding model)")
async def embeddings(request: Request) -> Response:
    service = PoolingService.of(request)
    body = await parse_json_body(request, EmbeddingRequest, service.payload_limit)
    return (await service.embeddings(body)).response()


@router.post("/pooling", summary="The pooled output of prompts (any pooling model)")
async def pooling(request: Request) -> Response:
    service = PoolingService.of(request)
    body = await parse_json_body(request, PoolingRequest, service.payload_limit)
    return (await service.pooling(body)).response()


@router.post("/classify", summary="Classify prompts (a sequence-classification model)")
async def classify(request: Request) -> Response:
    service = PoolingService.of(request)
    body = await parse_json_body(request, ClassificationRequest, service.payload_limit)
    return (await service.classify(body)).response()


@router.post("/get_score", summary="Score a conversation (a reward model)")
async def get_score(request: Request) -> Response:
    service = PoolingService.of(request)
    body = await parse_json_body(request, ScoreRequest, service.payload_limit)
    return (await service.score(body)).response()
