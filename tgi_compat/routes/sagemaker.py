"""POST /invocations (SageMaker): TGI's untagged `SagemakerRequest`, tried in order
Compat generate (`inputs`) -> Chat (`messages`) -> Completion (`prompt`); the first that fits
is answered exactly as its own route would answer it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tgi_compat.protocol.errors import BodyRejection, is_json_content_type, load_json, read_body
from tgi_compat.protocol.openapi import json_body
from tgi_compat.server.auth import require_api_key
from tgi_compat.server.state import get_state

router = APIRouter()

NO_VARIANT = "Failed to deserialize the JSON body into the target type: data did not match any variant of untagged enum SagemakerRequest"


def _replay(request: Request, raw: bytes) -> Request:
    """The same request with its body readable again (the handlers read it themselves)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(request.scope, receive)


@router.post(
    "/invocations",
    openapi_extra=json_body("CompatGenerateRequest"),
    dependencies=[Depends(require_api_key)],
    summary="Generate tokens from Sagemaker request",
)
async def sagemaker_compatibility(request: Request) -> Response:
    state = get_state(request)
    if not is_json_content_type(request.headers.get("content-type")):
        raise BodyRejection(415, "Expected request with `Content-Type: application/json`")
    raw = await read_body(request, state.config.payload_limit)
    document = load_json(raw)
    keys = document.keys() if isinstance(document, dict) else ()
    if "inputs" in keys:
        from tgi_compat.routes.generate import compat_generate

        return await compat_generate(_replay(request, raw))
    if "messages" in keys:
        from tgi_compat.routes.chat import chat_completions

        return await chat_completions(_replay(request, raw))
    if "prompt" in keys:
        from tgi_compat.routes.completions import completions

        return await completions(_replay(request, raw))
    raise BodyRejection(422, NO_VARIANT)
