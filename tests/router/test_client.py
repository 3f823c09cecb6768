"""The asyncio EngineClient with the engine loop in a thread, over the stand-in model."""

from __future__ import annotations

import asyncio

import pytest
from router_fakes import hash_engine
from test_engine import expected_greedy, prompts

from tgi_compat.router.client_api import EngineDeadError, Refusal, RequestRejectedError
from tgi_compat.router.client_in_process import InProcessEngineClient
from tgi_compat.router.client_queueing import PROGRESS_WINDOW_S, QueueingClient
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.stats import EngineStats, StepStats


async def collect(client, request):
    return [event async for event in client.generate(request)]


async def test_concurrent_requests_all_finish_with_their_own_tokens():
    client = InProcessEngineClient(hash_engine(max_running=8, max_prefill=16))
    try:
        batch = prompts(32)
        results = await asyncio.gather(
            *(collect(client, GenerateRequest(f"r{i}", p, max_new_tokens=10)) for i, p in enumerate(batch))
        )
        for prompt, events in zip(batch, results):
            assert [t for e in events for t in e.token_ids] == expected_greedy(prompt, 10)
            assert events[-1].finish_reason == "length"
        assert await client.check_health()
        assert client.core.pool.is_full_free()
    finally:
        await client.shutdown()


async def test_closing_the_iterator_aborts_and_frees_the_slots():
    client = InProcessEngineClient(hash_engine())
    try:
        stream = client.generate(GenerateRequest("long", prompts(1)[0], max_new_tokens=1000))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if not client.core.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert client.core.pool.is_full_free() and not client.core.has_unfinished()
    finally:
        await client.shutdown()


async def test_rejections_surface_before_anything_runs():
    client = InProcessEngineClient(hash_engine())
    try:
        with pytest.raises(RequestRejectedError) as refused:
            await collect(client, GenerateRequest("empty", []))
        assert refused.value.reason is Refusal.EMPTY_PROMPT
        assert not client.core.has_unfinished()
    finally:
        await client.shutdown()


async def test_a_dead_engine_thread_fails_pending_requests_at_once():
    engine = hash_engine()
    client = InProcessEngineClient(engine)

    def broken_step():
        raise RuntimeError("scheduler bug")

    engine.step = broken_step
    with pytest.raises(EngineDeadError, match="scheduler bug"):
        await asyncio.wait_for(collect(client, GenerateRequest("x", prompts(1)[0])), 5)
    with pytest.raises(EngineDeadError):
        await collect(client, GenerateRequest("y", prompts(1)[0]))
    assert not await client.check_health()


async def test_stats_reach_the_listener():
    client = InProcessEngineClient(hash_engine())
    received = []
    client.stats_listener = received.append
    try:
        await collect(client, GenerateRequest("s", prompts(1)[0], max_new_tokens=5))
        for _ in range(50):
            if received and received[-1].generated_tokens == 5:
                break
            await asyncio.sleep(0.1)
        assert received[-1].generated_tokens == 5 and received[-1].kv_used == 0
        assert client.latest_stats is received[-1]
    finally:
        await client.shutdown()


class _SilentEngine(QueueingClient):
    """An engine that never answers: only token events and stats reach the client."""

    def _submit(self, message) -> None:
        pass

    async def shutdown(self) -> None:
        pass


async def test_slow_steps_widen_the_window_in_which_progress_proves_health():
    client = _SilentEngine()
    client._dispatch([])  # token events arrived now
    assert await client.check_health(timeout=0.1)
    client._last_progress -= 2 * PROGRESS_WINDOW_S  # none since: a probe it never answers
    assert not await client.check_health(timeout=0.1)
    slow = PROGRESS_WINDOW_S  # a step as long as the plain window: busy, not hung
    client._on_stats(EngineStats(1, 1, 1, 1, 10, steps=[StepStats("decode", 1, slow, 0.0, slow)]))
    assert await client.check_health(timeout=0.1)
    client._on_stats(EngineStats(1, 1, 1, 1, 10, steps=[StepStats("decode", 1, 0.01, 0.0, 0.01)]))
    assert not await client.check_health(timeout=0.1)  # fast steps again: the plain window


def test_a_refusal_crosses_the_wire_as_its_code_and_values():
    from tgi_compat.router.wire import Rejected, encoder, engine_message_decoder

    sent = Rejected("r", Refusal.UNKNOWN_ADAPTER, ("nope", "a1"))
    received = engine_message_decoder.decode(encoder.encode(sent))
    assert received == sent and received.reason is Refusal.UNKNOWN_ADAPTER
