"""`--api-key`: generation routes need `Authorization: Bearer <key>`; a miss is 401, empty body."""

from __future__ import annotations

from fastapi import Request

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
