"""POST /, /generate, /generate_stream, /tokenize (docs/contract.md §2-§7): parse, then the
GenerateService (tgi_compat/api/serving/generate_service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.errors import parse_json_body
from tgi_compat.api.protocol.openapi import json_body
from tgi_compat.api.protocol.tgi import CompatGenerateRequest, GenerateRequest
from tgi_compat.api.routes.auth import require_api_key
from tgi_compat.api.serving.generate_service import GenerateService

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(
    "/",
    openapi_extra=json_body("CompatGenerateRequest"),
    summary="Generate tokens if `stream == false` or a stream of token if `stream == true`",
)
async def compat_generate(request: Request) -> Response:
    service = GenerateService.of(request)
    body = await parse_json_body(request, CompatGenerateRequest, service.payload_limit)
    return (await service.compat(body, request)).response()


@router.post("/generate", openapi_extra=json_body("GenerateRequest"), summary="Generate tokens")
async def generate(request: Request) -> Response:
    service = GenerateService.of(request)
    body = await parse_json_body(request, GenerateRequest, service.payload_limit)
    return (await service.generate(body, request, "generate")).response()


@router.post(
    "/generate_stream",
    openapi_extra=json_body("GenerateRequest"),
    summary="Generate a stream of token using Server-Sent Events",
)
async def generate_stream_route(request: Request) -> Response:
    service = GenerateService.of(request)
    body = await parse_json_body(request, GenerateRequest, service.payload_limit)
    return service.stream(body, request, "generate_stream").response()


@router.post("/tokenize", openapi_extra=json_body("GenerateRequest"), summary="Tokenize inputs")
async def tokenize(request: Request) -> Response:
    service = GenerateService.of(request)
    body = await parse_json_body(request, GenerateRequest, service.payload_limit)
    return (await service.tokenize(body)).response()
