"""AbortOnDisconnect against raw ASGI messages: a POST whose client leaves is cancelled at once."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect

from tgi_compat.api.serving.disconnect import AbortOnDisconnect

SCOPE = {"type": "http", "method": "POST", "path": "/generate"}
BODY = {"type": "http.request", "body": b"{}", "more_body": False}
DISCONNECT = {"type": "http.disconnect"}


def channel(*first: dict):
    messages: asyncio.Queue = asyncio.Queue()
    for message in first:
        messages.put_nowait(message)
    return messages, messages.get


async def test_a_handler_whose_client_leaves_is_cancelled_at_once():
    cancelled = asyncio.Event()

    async def app(scope, receive, send):
        await receive()
        try:
            await asyncio.sleep(30)  # a long non-streaming generation
        except asyncio.CancelledError:
            cancelled.set()
            raise

    messages, receive = channel(BODY)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    task = asyncio.create_task(AbortOnDisconnect(app)(SCOPE, receive, send))
    await asyncio.sleep(0.05)
    assert not task.done()
    messages.put_nowait(DISCONNECT)
    await asyncio.wait_for(task, 1)  # ends quietly: no exception for a client that left
    assert cancelled.is_set() and sent == []


async def test_a_complete_response_is_never_cancelled_and_the_handler_sees_the_disconnect_once():
    seen: list[dict] = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})
        seen.append(await receive())  # sse-starlette's listener waits like this

    _, receive = channel(BODY, DISCONNECT)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(AbortOnDisconnect(app)(SCOPE, receive, send), 1)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert seen == [DISCONNECT]


async def test_a_client_that_leaves_mid_body_costs_no_exception():
    async def app(scope, receive, send):
        if (await receive())["type"] == "http.disconnect":
            raise ClientDisconnect()

    _, receive = channel(DISCONNECT)

    async def send(message):
        raise AssertionError("nothing is sent to a client that left")

    await asyncio.wait_for(AbortOnDisconnect(app)(SCOPE, receive, send), 1)


async def test_get_requests_pass_straight_through():
    calls = []

    async def app(scope, receive, send):
        calls.append((scope["method"], receive, send))

    async def receive():
        return DISCONNECT

    async def send(message):
        pass

    await AbortOnDisconnect(app)({**SCOPE, "method": "GET", "path": "/health"}, receive, send)
    assert calls == [("GET", receive, send)]
