"""POST /v1/chat/completions and POST /chat_tokenize (docs/contract.md §9): parse, then the
ChatService (tgi_compat/api/serving/chat/service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.openai import ChatRequest
from tgi_compat.api.protocol.openai_common import parse_openai_body
from tgi_compat.api.routes.auth import documented, guarded_post
from tgi_compat.api.serving.chat.service import ChatService

router = APIRouter()


@guarded_post(router, "/v1/chat/completions", "Generate tokens", ChatRequest)
async def chat_completions(request: Request) -> Response:
    service, body = await ChatService.with_body(request, ChatRequest, parse_openai_body)
    return (await service.create(body)).response()


@router.post("/chat_tokenize", openapi_extra=documented(ChatRequest), summary="Template and tokenize ChatRequest")
async def chat_tokenize(request: Request) -> Response:
    """No API key (TGI)."""
    service, body = await ChatService.with_body(request, ChatRequest, parse_openai_body)
    return (await service.tokenize(body)).response()
