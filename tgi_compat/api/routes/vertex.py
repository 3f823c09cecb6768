"""POST /vertex (Vertex AI's prediction shape, served by TGI's image): parse the instances, then
the VertexService (tgi_compat/api/serving/vertex_service.py) answers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.errors import BodyRejection, is_json_content_type, read_body
from tgi_compat.api.routes.auth import guarded_post
from tgi_compat.api.serving.state import get_state
from tgi_compat.api.serving.vertex_service import VertexService, parse_instances

router = APIRouter()


@guarded_post(router, "/vertex", "Generate tokens from Vertex request")
async def vertex_compatibility(request: Request) -> Response:
    if not is_json_content_type(request.headers.get("content-type")):
        raise BodyRejection(415, "Expected request with `Content-Type: application/json`")
    instances = parse_instances(await read_body(request, get_state(request).config.payload_limit))
    return (await VertexService.of(request).predict(instances)).response()
