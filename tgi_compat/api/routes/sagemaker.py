"""POST /invocations (SageMaker): TGI's untagged `SagemakerRequest`, tried in order
Compat generate (`inputs`) -> Chat (`messages`) -> Completion (`prompt`); the first that fits
is answered exactly as its own route would answer it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tgi_compat.api.protocol.errors import BodyRejection, is_json_content_type, load_json, read_body
from tgi_compat.api.protocol.tgi import CompatGenerateRequest
from tgi_compat.api.routes.auth import guarded_post
from tgi_compat.api.serving.state import get_state

NO_VARIANT = "Failed to deserialize the JSON body into the target type: data did not match any variant of untagged enum SagemakerRequest"


Handler = Callable[[Request], Awaitable[Response]]


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


def build_router(variants: Sequence[tuple[str, Handler]]) -> APIRouter:
    """/invocations over the app's own handlers, as (key, handler) in TGI's variant order; the app
    passes them in, so this module imports no other route module."""
    router = APIRouter()

    @guarded_post(router, "/invocations", "Generate tokens from Sagemaker request", CompatGenerateRequest)
    async def sagemaker_compatibility(request: Request) -> Response:
        state = get_state(request)
        if not is_json_content_type(request.headers.get("content-type")):
            raise BodyRejection(415, "Expected request with `Content-Type: application/json`")
        raw = await read_body(request, state.config.payload_limit)
        document = load_json(raw)
        keys = document.keys() if isinstance(document, dict) else ()
        for key, handler in variants:
            if key in keys:  # the first key present picks the handler that answers
                return await handler(_replay(request, raw))
        raise BodyRejection(422, NO_VARIANT)

    return router
