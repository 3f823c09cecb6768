"""OpenAI-route unit tests: the real SmolLM2 tokenizer and chat template, the hand-scripted engine
of tests/api (every request answers " Paris is the capital." then EOS), the app in memory."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "api"))
from scripted_engine import EOS_ID, ScriptedEngine, make_state

from tgi_compat.api.server.app import create_app
from tgi_compat.api.serving.tokenization import TokenizerService

__all__ = ["EOS_ID"]


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer) -> TokenizerService:
    return TokenizerService(smollm2_tokenizer, workers=2)


@pytest.fixture
def continuation(tokenizer) -> list[int]:
    return tokenizer.encode_sync(" Paris is the capital.", add_special_tokens=False)


@pytest.fixture
def engine(continuation) -> ScriptedEngine:
    return ScriptedEngine(continuation, max_total_tokens=256)


@pytest.fixture
def make_client(tokenizer) -> Callable[..., httpx.AsyncClient]:
    def build(engine: ScriptedEngine, chat_template=None, **overrides) -> httpx.AsyncClient:
        app = create_app(make_state(engine, tokenizer, **overrides))
        if chat_template is not None:
            app.state.chat_template = chat_template  # routes/chat.py keeps the loaded template here
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")

    return build


@pytest.fixture
async def client(engine, make_client):
    async with make_client(engine) as http:
        yield http
