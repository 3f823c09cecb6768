"""Fixtures every test tree shares.

transformers' reference model of the embedded SmolLM2 loads once per session for all of them
(tests.modeling.helpers.smollm2_reference_model: converted from the GGUF once, then cached).
The API tests (tests/api, tests/openai) drive the real app over an in-memory transport, with the real
SmolLM2 tokenizer and chat template and the scripted engine (tests/scripted_engine.py: every request
answers " Paris is the capital." then EOS): `client`, or `make_client(engine, **config)` for another.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from unittest import mock

import pytest
import torch

from tests.modeling.helpers import smollm2_reference_model
from tests.xdist_threads import share_the_cores_among_xdist_workers

if TYPE_CHECKING:
    import httpx
    from scripted_engine import ScriptedEngine

    from tgi_compat.api.serving.tokenization import TokenizerService


def _import_triton_interpreted() -> None:
    """Without a GPU, Triton's own @jit helpers (tl.cdiv, the reductions, gluon's copies) must be
    the interpreter's: Triton decorates them once, when it is first imported, so that import happens
    here, before any test module pulls in a kernel. The variable is restored at once so that server
    subprocesses started by tests do not inherit it (tests/kernels/conftest.py re-imports tgi_compat/kernels/)."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        import triton.experimental.gluon  # noqa: F401  (imports triton.language as well)


share_the_cores_among_xdist_workers()
if not torch.cuda.is_available():
    _import_triton_interpreted()


@pytest.fixture(scope="session")
def smollm2_hf_model():
    return smollm2_reference_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded model's tokenizer (converted from the GGUF once, then cached)."""
    from tgi_compat.modeling.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer) -> TokenizerService:
    from tgi_compat.api.serving.tokenization import TokenizerService

    return TokenizerService(smollm2_tokenizer, workers=2)


@pytest.fixture
def continuation(tokenizer) -> list[int]:
    return tokenizer.encode_sync(" Paris is the capital.", add_special_tokens=False)


@pytest.fixture
def engine(continuation) -> ScriptedEngine:
    from scripted_engine import ScriptedEngine

    return ScriptedEngine(continuation)


@pytest.fixture
def make_client(tokenizer) -> Callable[..., httpx.AsyncClient]:
    import httpx
    from scripted_engine import make_state

    from tgi_compat.api.server.app import create_app

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
