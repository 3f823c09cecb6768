"""POST /, /generate, /generate_stream, /tokenize (docs/contract.md §2-§7): parse, then the
GenerateService (tgi_compat/api/serving/generate_service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.tgi import CompatGenerateRequest, GenerateRequest
from tgi_compat.api.routes.auth import guarded_post
from tgi_compat.api.serving.generate_service import GenerateService

router = APIRouter()


@guarded_post(
    router, "/", "Generate tokens if `stream == false` or a stream of token if `stream == true`", CompatGenerateRequest
)
async def compat_generate(request: Request) -> Response:
    service, body = await GenerateService.with_body(request, CompatGenerateRequest)
    return (await service.compat(body, request)).response()


@guarded_post(router, "/generate", "Generate tokens", GenerateRequest)
async def generate(request: Request) -> Response:
    service, body = await GenerateService.with_body(request, GenerateRequest)
    return (await service.generate(body, request, "generate")).response()


@guarded_post(router, "/generate_stream", "Generate a stream of token using Server-Sent Events", GenerateRequest)
async def generate_stream_route(request: Request) -> Response:
    service, body = await GenerateService.with_body(request, GenerateRequest)
    return service.stream(body, request, "generate_stream").response()


@guarded_post(router, "/tokenize", "Tokenize inputs", GenerateRequest)
async def tokenize(request: Request) -> Response:
    service, body = await GenerateService.with_body(request, GenerateRequest)
    return (await service.tokenize(body)).response()
