"""install_security over a small FastAPI app, driven through httpx's ASGI transport."""

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tgi_compat.api.server.security import PAYLOAD_TOO_LARGE, install_security


def make_app(**security) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.body()
        return JSONResponse({"received": len(body)})

    @app.post("/generate_stream")
    async def generate_stream():
        async def events():
            for i in range(3):
                yield f"data:{i}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/")
    async def health():
        return PlainTextResponse("")

    @app.post("/")
    async def compat(request: Request):
        return JSONResponse({"ok": True})

    @app.get("/info")
    async def info():
        return JSONResponse({"model_id": "x"})

    install_security(app, **security)
    return app


def client(**security) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(**security)), base_url="http://t")


async def test_api_key_guards_generation_routes_only():
    async with client(api_key="secret", cors_origins=None, payload_limit=1000) as c:
        denied = await c.post("/generate", json={"inputs": "hi"})
        assert denied.status_code == 401 and denied.content == b""
        wrong = await c.post("/generate", json={}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await c.post("/generate", json={}, headers={"Authorization": "bearer SECRET"})  # case-insensitive
        assert ok.status_code == 200
        assert (await c.post("/", json={})).status_code == 401
        assert (await c.get("/")).status_code == 200  # GET / is health, open
        assert (await c.get("/info")).status_code == 200
        streamed = await c.post("/generate_stream", json={}, headers={"Authorization": "Bearer secret"})
        assert streamed.status_code == 200 and streamed.text == "data:0\n\ndata:1\n\ndata:2\n\n"


async def test_no_api_key_means_open():
    async with client(api_key=None, cors_origins=None, payload_limit=1000) as c:
        assert (await c.post("/generate", json={})).status_code == 200


async def test_cors_any_origin():
    async with client(api_key="k", cors_origins=[], payload_limit=1000) as c:
        preflight = await c.options(
            "/generate",
            headers={"Origin": "http://a.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200 and preflight.content == b""  # before the api key check
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert preflight.headers["access-control-allow-methods"] == "GET,POST"
        assert preflight.headers["access-control-allow-headers"] == "content-type"
        assert "origin" in preflight.headers["vary"]
        info = await c.get("/info", headers={"Origin": "http://a.example"})
        assert info.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-methods" not in info.headers


async def test_cors_origin_list():
    async with client(api_key=None, cors_origins=["http://good.example"], payload_limit=1000) as c:
        good = await c.get("/info", headers={"Origin": "http://good.example"})
        assert good.headers["access-control-allow-origin"] == "http://good.example"
        bad = await c.get("/info", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in bad.headers
        pre = await c.options("/generate", headers={"Origin": "http://evil.example"})
        assert pre.status_code == 200 and "access-control-allow-origin" not in pre.headers


async def test_payload_limit_declared_length():
    async with client(api_key=None, cors_origins=None, payload_limit=100) as c:
        small = await c.post("/generate", content=b"x" * 100, headers={"content-type": "application/json"})
        assert small.status_code == 200 and small.json() == {"received": 100}
        big = await c.post("/generate", content=b"x" * 101, headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.content == PAYLOAD_TOO_LARGE
        assert big.headers["content-type"].startswith("text/plain")


async def test_payload_limit_chunked_body():
    async def chunks():
        for _ in range(5):
            yield b"y" * 40

    async with client(api_key=None, cors_origins=None, payload_limit=100) as c:
        big = await c.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.content == PAYLOAD_TOO_LARGE


async def test_unauthorized_beats_payload_limit():
    async with client(api_key="k", cors_origins=None, payload_limit=10) as c:
        r = await c.post("/generate", content=b"z" * 50, headers={"content-type": "application/json"})
        assert r.status_code == 401


@pytest.mark.parametrize("content_type", ["text/plain", None])
async def test_non_json_bodies_are_left_to_the_route(content_type):
    headers = {"content-type": content_type} if content_type else {}
    async with client(api_key=None, cors_origins=None, payload_limit=10) as c:
        r = await c.post("/generate", content=b"z" * 50, headers=headers)
        assert r.status_code == 200  # the real route answers 415 here, as axum's Json extractor would
