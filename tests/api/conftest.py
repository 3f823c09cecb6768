"""API-layer unit tests: the real tokenizer, a hand-scripted engine, and the FastAPI app over an
in-memory transport."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from scripted_engine import ScriptedEngine, make_state

from tgi_compat.api.server.app import create_app
from tgi_compat.api.serving.tokenization import TokenizerService


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer) -> TokenizerService:
    return TokenizerService(smollm2_tokenizer, workers=2)


@pytest.fixture
def continuation(tokenizer) -> list[int]:
    return tokenizer.encode_sync(" Paris is the capital.", add_special_tokens=False)


@pytest.fixture
def engine(continuation) -> ScriptedEngine:
    return ScriptedEngine(continuation)


@pytest.fixture
def make_client(tokenizer) -> Callable[..., httpx.AsyncClient]:
    def build(engine: ScriptedEngine, **overrides) -> httpx.AsyncClient:
        app = create_app(make_state(engine, tokenizer, **overrides))
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")

    return build


@pytest.fixture
async def client(engine, make_client):
    async with make_client(engine) as http:
        yield http
