"""TGI's wire contract over raw HTTP against the real server (docs/contract.md §1-§8, §18)."""

from __future__ import annotations

import asyncio
import json

import httpx
from harness import CHAT_PROMPT, MAX_CONCURRENT_REQUESTS

GREEDY = {"max_new_tokens": 3}


def _events(raw: bytes) -> list[dict]:
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    chunks = [c for c in raw.split(b"\n\n") if c and c != b":"]
    assert all(c.startswith(b"data:{") for c in chunks), chunks  # no space, no event:/id: lines
    return [json.loads(c[5:]) for c in chunks]


async def test_generate_is_an_object_and_root_is_a_list(http):
    body = {"inputs": CHAT_PROMPT, "parameters": GREEDY}
    generate = await http.post("/generate", json=body)
    assert generate.json() == {"generated_text": "The capital of"}  # no details key
    root = await http.post("/", json=body)
    assert root.json() == [{"generated_text": CHAT_PROMPT + "The capital of"}]


async def test_timing_headers_on_non_stream_responses(http):
    response = await http.post("/generate", json={"inputs": CHAT_PROMPT, "parameters": GREEDY})
    headers = response.headers
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert headers[name].isdigit(), name
    assert float(headers["x-compute-time"]) > 0
    assert headers["x-generated-tokens"] == "3" and int(headers["x-prompt-tokens"]) > 5
    assert headers["x-compute-characters"] == str(len(CHAT_PROMPT))


async def test_stream_bytes(http):
    body = {"inputs": CHAT_PROMPT, "parameters": {**GREEDY, "details": True}}
    async with http.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["transfer-encoding"] == "chunked"
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    events = _events(raw)
    assert [e["index"] for e in events] == [1, 2, 3]
    assert events[-1]["generated_text"] == "The capital of"
    assert set(events[-1]["details"]) == {"finish_reason", "generated_tokens", "seed", "input_length"}


async def test_stream_validation_error_is_an_event_on_200(http):
    response = await http.post("/generate_stream", json={"inputs": CHAT_PROMPT, "parameters": {"top_k": 0}})
    assert response.status_code == 200
    assert _events(response.content) == [
        {"error": "Input validation error: `top_k` must be strictly positive", "error_type": "validation"}
    ]


async def test_body_rejections(http):
    cases = [
        (b"{}", "text/plain", 415, "Expected request with `Content-Type: application/json`"),
        (b"{nope", "application/json", 400, "Failed to parse the request body as JSON: "),
        (b'{"parameters":{}}', "application/json", 422, "Failed to deserialize the JSON body into the target type: missing field `inputs`"),
        (b'{"inputs":"a","parameters":{"stop":null}}', "application/json", 422, "Failed to deserialize the JSON body into the target type: parameters.stop"),
    ]  # fmt: skip
    for content, content_type, status, text in cases:
        response = await http.post("/generate", content=content, headers={"content-type": content_type})
        assert response.status_code == status and response.text.startswith(text), response.text
        assert response.headers["content-type"].startswith("text/plain")
    too_big = await http.post("/generate", json={"inputs": "x" * 2_000_001})
    assert (too_big.status_code, too_big.text) == (413, "Failed to buffer the request body: length limit exceeded")


async def test_unknown_path_and_method(http):
    assert (await http.get("/nope")).status_code == 404
    wrong = await http.get("/generate")
    assert (wrong.status_code, wrong.content) == (405, b"")


async def test_info_health_models_metrics_tokenize(http):
    info = (await http.get("/info")).json()
    assert info["max_total_tokens"] == 512 and info["max_input_tokens"] == 511
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/v1/models")).json()["data"][0]["id"] == info["model_id"]
    metrics = (await http.get("/metrics")).text
    assert "tgi_request_count" in metrics
    tokens = (await http.post("/tokenize", json={"inputs": "Ünïcode"})).json()
    assert tokens[-1]["stop"] == len("Ünïcode".encode())


async def _hold_stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> None:
    """Reads a stream until cancelled (cancelling closes the connection: a client leaving)."""
    async with client.stream("POST", "/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith('data:{"index":'):
                started.set()


async def test_overload_429_and_disconnect_frees_permits(base_url):
    body = {"inputs": "Count from 1 to 100: 1, 2, 3,", "parameters": {"max_new_tokens": 100}}
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        started = [asyncio.Event() for _ in range(MAX_CONCURRENT_REQUESTS)]
        readers = [asyncio.create_task(_hold_stream(client, body, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 300)
        overloaded = await client.post("/generate", json={"inputs": CHAT_PROMPT, "parameters": GREEDY})
        assert overloaded.status_code == 429
        assert overloaded.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        streaming = await client.post("/generate_stream", json={"inputs": CHAT_PROMPT, "parameters": GREEDY})
        assert _events(streaming.content) == [overloaded.json()]  # on 200, as an event
        for reader in readers:  # clients leave mid-stream: the server aborts their engine requests
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        response = await client.post("/generate", json={"inputs": CHAT_PROMPT, "parameters": GREEDY})
        assert response.status_code == 200, response.text
