"""POST /v1/chat/completions and POST /chat_tokenize (docs/contract.md §9): parse, then the
ChatService (tgi_compat/api/serving/chat/service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.openai import ChatRequest
from tgi_compat.api.protocol.openai_common import parse_openai_body
from tgi_compat.api.protocol.openapi import json_body, register_schemas
from tgi_compat.api.routes.auth import require_api_key
from tgi_compat.api.serving.chat.service import ChatService
from tgi_compat.api.serving.state import get_state

router = APIRouter()
register_schemas(ChatRequest)


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body("ChatRequest"),
    dependencies=[Depends(require_api_key)],
    summary="Generate tokens",
)
async def chat_completions(request: Request) -> Response:
    body = await parse_openai_body(request, ChatRequest, get_state(request).config.payload_limit)
    return (await ChatService.of(request).create(body)).response()


@router.post("/chat_tokenize", openapi_extra=json_body("ChatRequest"), summary="Template and tokenize ChatRequest")
async def chat_tokenize(request: Request) -> Response:
    """No API key (TGI)."""
    body = await parse_openai_body(request, ChatRequest, get_state(request).config.payload_limit)
    return (await ChatService.of(request).tokenize(body)).response()
