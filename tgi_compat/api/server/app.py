"""The FastAPI application: TGI's routes over one AppState.

Composition: each route module exposes an `APIRouter`; `create_app` includes the modules listed
in `_route_modules()` plus any `extra_routers`. A route reaches the engine, tokenizer, limits and
config through `get_state(request)` (tgi_compat.api.serving.state), and protects generation endpoints with
`Depends(require_api_key)` (tgi_compat.api.routes.auth).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tgi_compat.api.protocol.errors import BodyRejection, TgiError
from tgi_compat.api.protocol.openapi import build_openapi
from tgi_compat.api.protocol.tgi import TGI_VERSION
from tgi_compat.api.routes.auth import Unauthorized
from tgi_compat.api.server.security import install_security
from tgi_compat.api.serving.disconnect import AbortOnDisconnect
from tgi_compat.api.serving.state import AppState


def _route_modules() -> list[APIRouter]:
    # NOTE(owners of chat/openai/lightllm routes): add your router here with one line.
    from tgi_compat.api.routes import chat, completions, generate, info, pooling, sagemaker, vertex

    invocations = sagemaker.build_router(
        [("inputs", generate.compat_generate), ("messages", chat.chat_completions), ("prompt", completions.completions)]
    )
    return [generate.router, info.router, chat.router, completions.router, invocations, vertex.router, pooling.router]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BodyRejection)
    async def body_rejection(_: Request, error: BodyRejection) -> Response:
        return error.response()

    @app.exception_handler(TgiError)
    async def tgi_error(_: Request, error: TgiError) -> Response:
        return error.response()

    @app.exception_handler(Unauthorized)
    async def unauthorized(_: Request, __: Unauthorized) -> Response:
        return Response(status_code=401)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        # axum answers unknown paths (404) and wrong methods (405) with an empty body.
        return Response(status_code=error.status_code, headers=error.headers)


def create_app(state: AppState, extra_routers: Sequence[APIRouter] = ()) -> FastAPI:
    app = FastAPI(
        title="Text Generation Inference",
        version=TGI_VERSION,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/api-doc/openapi.json",
        redirect_slashes=False,  # axum has no such redirect: `POST /generate/` is a 404, not a 307 to /generate
    )
    app.state.tgi = state
    _install_error_handlers(app)
    for router in [*_route_modules(), *extra_routers]:
        app.include_router(router)
    config = state.config
    app.add_middleware(AbortOnDisconnect)  # inside the security layer: its 413 and CORS stay outermost
    install_security(app, config.api_key, config.cors_allow_origin, config.payload_limit)  # CORS, key, size
    app.openapi = lambda: build_openapi(app, TGI_VERSION)  # type: ignore[method-assign]
    return app
