"""POST /v1/completions (docs/contract.md §10): parse, then the CompletionService
(tgi_compat/api/serving/completions/service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.openai import CompletionRequest
from tgi_compat.api.protocol.openai_common import parse_openai_body
from tgi_compat.api.protocol.openapi import json_body, register_schemas
from tgi_compat.api.routes.auth import require_api_key
from tgi_compat.api.serving.completions.service import CompletionService

router = APIRouter()
register_schemas(CompletionRequest)


@router.post(
    "/v1/completions",
    openapi_extra=json_body("CompletionRequest"),
    dependencies=[Depends(require_api_key)],
    summary="Generate tokens",
)
async def completions(request: Request) -> Response:
    service = CompletionService.of(request)
    body = await parse_openai_body(request, CompletionRequest, service.payload_limit)
    return (await service.create(body)).response()
