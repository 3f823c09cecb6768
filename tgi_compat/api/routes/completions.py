"""POST /v1/completions (docs/contract.md §10): parse, then the CompletionService
(tgi_compat/api/serving/completions/service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.openai import CompletionRequest
from tgi_compat.api.protocol.openai_common import parse_openai_body
from tgi_compat.api.routes.auth import guarded_post
from tgi_compat.api.serving.completions.service import CompletionService

router = APIRouter()


@guarded_post(router, "/v1/completions", "Generate tokens", CompletionRequest)
async def completions(request: Request) -> Response:
    service, body = await CompletionService.with_body(request, CompletionRequest, parse_openai_body)
    return (await service.create(body)).response()
