"""The server runs on uvloop + httptools when they are installed, on asyncio + h11 when not."""

from __future__ import annotations

import importlib.util
import sys

import uvicorn

from tgi_compat.api.server.process import event_loop_factory


def test_uvloop_is_the_event_loop_when_installed():
    import uvloop  # a dependency; the GPU wheelhouse may lack it, hence the fallback below

    assert event_loop_factory() is uvloop.new_event_loop


def test_asyncio_loop_without_uvloop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what a missing package looks like to import
    assert event_loop_factory() is None  # asyncio.Runner's default loop


def test_uvicorn_picks_httptools_when_installed():
    assert importlib.util.find_spec("httptools") is not None  # a dependency; without it uvicorn falls back to h11

    config = uvicorn.Config(app=lambda scope, receive, send: None, lifespan="off")
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
