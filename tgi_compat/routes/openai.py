"""The OpenAI-compatible routes as one router for `app._route_modules()`:
/v1/chat/completions and /chat_tokenize (routes_chat), /v1/completions (routes_completions)."""

from __future__ import annotations

from fastapi import APIRouter

from tgi_compat.routes import chat as routes_chat
from tgi_compat.routes import completions as routes_completions

router = APIRouter()
router.include_router(routes_chat.router)
router.include_router(routes_completions.router)
