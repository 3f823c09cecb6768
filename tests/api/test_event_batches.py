"""Tokens that reach the API together (a stream that fell behind) go out together, same bytes.

`_BatchingEngine` hands every event of a request over at once through `generate_batches`, the
way tgi_compat.router.client_queueing does when several steps arrived before the stream task ran; the SSE body must
be byte for byte what one-event-at-a-time delivery gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from scripted_engine import ScriptedEngine

from tgi_compat.router.client_api import EngineDeadError
from tgi_compat.router.client_queueing import RequestEvents
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest

PROMPT = "What is the capital of France?"


class _BatchingEngine(ScriptedEngine):
    """The scripted engine's events, all in one batch (or split where `split_after` says)."""

    split_after: int | None = None

    async def generate_batches(self, request: GenerateRequest) -> AsyncIterator[list[TokenEvent]]:
        events = [event async for event in self.generate(request)]
        cut = len(events) if self.split_after is None else self.split_after
        for batch in (events[:cut], events[cut:]):
            if batch:
                yield batch


async def _stream(make_client, engine, parameters: dict) -> bytes:
    async with make_client(engine) as http:
        response = await http.post("/generate_stream", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200
    return response.content


@pytest.mark.parametrize(
    "parameters",
    [
        {"max_new_tokens": 20},
        {"max_new_tokens": 20, "details": True, "seed": 3, "do_sample": True},
        {"max_new_tokens": 4, "details": True},  # length mid-way
        {"max_new_tokens": 20, "stop": [" the"], "details": True},  # stop string mid-batch
        {"max_new_tokens": 20, "top_n_tokens": 2, "details": True},
        {"max_new_tokens": 20, "decoder_input_details": True, "details": True},
    ],
)
@pytest.mark.parametrize("split_after", [None, 1, 3])
async def test_batched_delivery_sends_the_same_bytes(make_client, continuation, parameters, split_after):
    one_by_one = await _stream(make_client, ScriptedEngine(continuation), parameters)
    batching = _BatchingEngine(continuation)
    batching.split_after = split_after
    batched = await _stream(make_client, batching, parameters)
    assert batched == one_by_one
    assert batched.count(b"data:") == one_by_one.count(b"\n\n")  # one SSE event per token


async def test_tokens_before_an_engine_error_are_sent_then_the_error(make_client, continuation):
    class FailsAfterTwo(_BatchingEngine):
        async def generate_batches(self, request):
            events = self._events(request)[:2]
            events.append(TokenEvent(request.request_id, finish_reason="error", error="CUDA out of memory"))
            yield events

    body = (await _stream(make_client, FailsAfterTwo(continuation), {"max_new_tokens": 20})).decode()
    events = [line for line in body.split("\n\n") if line]
    assert len(events) == 3
    assert events[0].startswith('data:{"index":1,') and events[1].startswith('data:{"index":2,')
    assert (
        events[2] == 'data:{"error":"Request failed during generation: CUDA out of memory","error_type":"generation"}'
    )


async def test_request_events_hand_over_everything_then_the_error():
    events = RequestEvents()
    first, second = TokenEvent("r", [1]), TokenEvent("r", [2])
    events.put(first)
    events.put(second)
    events.fail(EngineDeadError("gone"))
    assert await events.take_all() == [first, second]  # what arrived before the failure still counts
    with pytest.raises(EngineDeadError):
        await events.take_all()


async def test_request_events_wake_a_waiting_consumer():
    events = RequestEvents()
    waiting = asyncio.create_task(events.take_all())
    await asyncio.sleep(0)
    assert not waiting.done()
    event = TokenEvent("r", [7])
    events.put(event)
    assert await asyncio.wait_for(waiting, 1) == [event]
