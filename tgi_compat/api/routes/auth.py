"""`--api-key`: generation routes need `Authorization: Bearer <key>`; a miss is 401, empty body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from tgi_compat.api.protocol.openapi import json_body, register_schemas
from tgi_compat.api.serving.state import get_state


class Unauthorized(Exception):
    """Answered by the app as a bare 401 (TGI sends no body)."""


def require_api_key(request: Request) -> None:
    """FastAPI dependency for the generation routes (/, /generate*, /tokenize, /v1/* generation)."""
    api_key = get_state(request).config.api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header.lower() != f"bearer {api_key}".lower():  # TGI compares the whole header case-insensitively
        raise Unauthorized()


Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def guarded_post(
    router: APIRouter, path: str, summary: str, body: type[BaseModel] | None = None
) -> Callable[[Endpoint], Endpoint]:
    """`router.post` for a generation route: behind the API key, its JSON body documented as `body`'s
    schema (the routes read their bodies themselves, so FastAPI cannot infer it)."""
    return router.post(path, openapi_extra=documented(body), dependencies=[Depends(require_api_key)], summary=summary)


def documented(body: type[BaseModel] | None) -> dict[str, Any] | None:
    """`openapi_extra` naming `body`'s schema, which joins the document's components."""
    if body is None:
        return None
    register_schemas(body)
    return json_body(body.__name__)
