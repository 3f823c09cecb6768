"""The engine process's I/O overlapped with the GPU's step (EngineConfig.overlap_host_io).

On a GPU, StepExecutor calls `while_gpu_works` between launching a step and waiting for it; the
engine process sends the previous step's events and reads new messages there. On CPU the hook
runs after a synchronous forward, which is slower but exercises the same code paths, so these
tests force it on and check it against the plain loop: same events, same wire order rules.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
import time

import pytest
import zmq

from router.client import ZmqEngineClient
from router.config import EngineConfig
from router.engine_process import run_engine_process
from router.outputs import TokenEvent
from router.request import GenerateRequest, SamplingParams
from router.sampling import SamplerOutput
from router.wire import (
    AbortRequest,
    AddRequest,
    Ready,
    Shutdown,
    StatsReport,
    StepOutputs,
    encoder,
    engine_message_decoder,
)
from router_fakes import HashRunner, hash_engine
from smollm2_cases import SMOLLM2_MAX_NEW, SMOLLM2_PROMPTS, smollm2_engine_config
from test_engine import expected_greedy, prompts, tokens_of


# ---- the executor's hook, over the stand-in model -----------------------------------------------
def run_with_hook(engine, hook, max_steps: int = 10_000) -> dict[str, list[TokenEvent]]:
    engine.while_gpu_works = hook
    events: dict[str, list[TokenEvent]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    assert engine.pool.is_full_free() and not engine.has_unfinished()
    return events


def test_the_hook_runs_once_per_step_after_the_launch_and_before_the_wait(monkeypatch):
    engine = hash_engine(max_prefill=6)  # chunked prompts: steps without sampled rows too
    log: list[str] = []
    forward = engine.executor.runner.forward
    monkeypatch.setattr(engine.executor.runner, "forward", lambda batch: (log.append("forward"), forward(batch))[1])
    to_host = SamplerOutput.to_host
    monkeypatch.setattr(SamplerOutput, "to_host", lambda self: (log.append("to_host"), to_host(self))[1])
    batch = prompts(4, length=14)  # r0's prompt fills the first two steps: nothing sampled in them
    for i, prompt in enumerate(batch):
        engine.add_request(GenerateRequest(f"r{i}", prompt, max_new_tokens=5, prompt_logprobs=i == 1))
    events = run_with_hook(engine, lambda: log.append("hook"))
    for i, prompt in enumerate(batch):
        assert tokens_of(events[f"r{i}"]) == expected_greedy(prompt, 5)
    steps = "".join("F" if e == "forward" else "H" if e == "hook" else "T" for e in log).split("F")[1:]
    # One hook per step, before any wait: "H" nothing sampled, "HT" sampled, "HTT" prompt logprobs too.
    assert steps and all(step in ("H", "HT", "HTT") for step in steps), steps
    assert {"H", "HT", "HTT"} <= set(steps)


def test_the_hook_runs_once_when_a_batch_fails_and_is_retried_one_by_one():
    runner = HashRunner()
    runner.fail_on_token = 0
    engine = hash_engine(runner=runner)
    engine.add_request(GenerateRequest("bad", [5, 0, 7], max_new_tokens=3))
    engine.add_request(GenerateRequest("ok", prompts(1)[0], max_new_tokens=3))
    calls = []
    engine.while_gpu_works = lambda: calls.append(runner.num_forwards)
    events = engine.step()
    assert runner.num_forwards == 3 and len(calls) == 1  # the batch, then each chunk alone
    assert [(e.request_id, e.finish_reason) for e in events] == [("bad", "error"), ("ok", None)]


def test_a_step_with_nothing_to_run_does_not_call_the_hook():
    engine = hash_engine()
    engine.add_request(GenerateRequest("a", prompts(1)[0], max_new_tokens=50))
    engine.abort("a")
    calls = []
    engine.while_gpu_works = lambda: calls.append(1)
    assert [(e.request_id, e.finish_reason) for e in engine.step()] == [("a", "abort")]
    assert calls == [] and engine.pool.is_full_free()


def test_a_failing_hook_neither_fails_the_step_nor_is_lost():
    engine = hash_engine()
    prompt = prompts(1)[0]
    engine.add_request(GenerateRequest("a", prompt, max_new_tokens=4))

    def broken_hook():
        raise ConnectionError("socket gone")

    engine.while_gpu_works = broken_hook
    with pytest.raises(ConnectionError, match="socket gone"):
        engine.step()
    assert engine.scheduler.requests["a"].output_ids == expected_greedy(prompt, 1)  # the step was applied
    assert tokens_of(run_with_hook(engine, None)["a"]) == expected_greedy(prompt, 4)[1:]


def test_requests_added_and_aborted_by_the_hook_take_effect_at_the_next_step():
    engine = hash_engine(max_running=4)
    batch = prompts(6)
    engine.add_request(GenerateRequest("long", batch[0], max_new_tokens=200))
    engine.add_request(GenerateRequest("ends", batch[1], max_new_tokens=3))  # its last token is this step's
    actions = {
        2: lambda: [engine.add_request(GenerateRequest(f"new{i}", batch[2 + i], max_new_tokens=6)) for i in range(4)],
        3: lambda: (engine.abort("long"), engine.abort("ends")),  # both are in this step's plan
    }
    step = iter(range(1, 1_000))
    events = run_with_hook(engine, lambda: actions.get(next(step), lambda: None)())
    assert [e.finish_reason for e in events["long"]] == [None, None, None, "abort"]
    assert tokens_of(events["long"]) == expected_greedy(batch[0], 3)
    assert tokens_of(events["ends"]) == expected_greedy(batch[1], 3) and events["ends"][-1].finish_reason == "length"
    for i in range(4):  # max_running=4: one of them queued until "long" and "ends" left
        assert tokens_of(events[f"new{i}"]) == expected_greedy(batch[2 + i], 6), i


# ---- the engine loop in this process, over the stand-in model ----------------------------------
class RecordingOutbox:
    """Stands in for the loop's PUSH socket: decodes and logs what is sent, in order."""

    def __init__(self, log: list, on_send) -> None:
        self.log, self.on_send = log, on_send

    def send(self, data: bytes) -> None:
        self.log.append(engine_message_decoder.decode(data))
        self.on_send()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_the_loop_holds_events_for_one_step_at_most_and_flushes_when_idle(overlap):
    from router.engine_process import _EngineLoop

    engine = hash_engine()
    log: list = []
    forward = engine.executor.runner.forward
    engine.executor.runner.forward = lambda batch: (log.append("forward"), forward(batch))[1]
    context = zmq.Context()
    to_engine, inbox = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    inbox.bind("inproc://overlap-test")
    to_engine.connect("inproc://overlap-test")

    def stop_when_done():
        if any(isinstance(m, StepOutputs) and m.events[-1].finish_reason for m in log if m != "forward"):
            to_engine.send(encoder.encode(Shutdown()))

    try:
        to_engine.send(encoder.encode(AddRequest(GenerateRequest("a", prompts(1)[0], max_new_tokens=6))))
        loop = _EngineLoop(engine, inbox, RecordingOutbox(log, stop_when_done), os.getppid(), overlap)
        loop.run()
    finally:
        to_engine.close(linger=0)
        inbox.close(linger=0)
        context.term()
    sent_before_forward, tokens_sent = [], 0
    for entry in log:
        if entry == "forward":
            sent_before_forward.append(tokens_sent)
        elif isinstance(entry, StepOutputs):
            tokens_sent += sum(len(e.token_ids) for e in entry.events)
        else:
            assert isinstance(entry, StatsReport) and entry.stats.generated_tokens <= tokens_sent
    lag = 1 if overlap else 0  # step k's token leaves during step k+1's GPU work, or before it starts
    assert sent_before_forward == [max(0, k - lag) for k in range(6)]
    assert tokens_sent == 6 and log[-1] != "forward"  # the last token left without another step
    assert isinstance(log[-1], StatsReport) and log[-1].stats.kv_used == 0


# ---- the engine process, spoken to over raw sockets: every message in wire order ---------------
class WireEngine:
    """run_engine_process in a spawned process, as ZmqEngineClient starts it, without the client."""

    def __init__(self, config: EngineConfig) -> None:
        self.socket_dir = tempfile.mkdtemp(prefix="overlap-test-")
        self.context = zmq.Context()
        self.outbox, self.inbox = self.context.socket(zmq.PUSH), self.context.socket(zmq.PULL)
        self.outbox.bind(f"ipc://{self.socket_dir}/input")
        self.inbox.bind(f"ipc://{self.socket_dir}/output")
        args = (config, f"ipc://{self.socket_dir}/input", f"ipc://{self.socket_dir}/output", os.getpid())
        self.process = multiprocessing.get_context("spawn").Process(target=run_engine_process, args=args, daemon=True)
        self.process.start()
        assert isinstance(self.receive(timeout_s=300), Ready)
        self.messages: list = []  # everything after Ready, in arrival order

    def send(self, message) -> None:
        self.outbox.send(encoder.encode(message))

    def receive(self, timeout_s: float = 60):
        if not self.inbox.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"nothing from the engine for {timeout_s} s")
        return engine_message_decoder.decode(self.inbox.recv())

    def events_until(self, done) -> dict[str, list[TokenEvent]]:
        """Read until `done(events by request)`; nothing is sent meanwhile, so whatever the engine
        holds back must reach us on its own."""
        while not done(self.events()):
            self.messages.append(self.receive())
        return self.events()

    def events(self) -> dict[str, list[TokenEvent]]:
        events: dict[str, list[TokenEvent]] = {}
        for message in self.messages:
            if isinstance(message, StepOutputs):
                for event in message.events:
                    events.setdefault(event.request_id, []).append(event)
        return events

    def idle_report(self) -> StatsReport:
        """The StatsReport the engine sends when it goes idle (gauges at zero)."""
        while True:
            message = self.receive()
            self.messages.append(message)
            if isinstance(message, StatsReport) and message.stats.running == 0 and message.stats.queue_size == 0:
                return message

    def close(self) -> None:
        if self.process.is_alive():
            self.send(Shutdown())
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
        self.outbox.close(linger=0)
        self.inbox.close(linger=0)
        self.context.term()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def finished(*request_ids):
    return lambda events: all(events.get(i) and events[i][-1].finish_reason for i in request_ids)


def check_wire_order(messages: list) -> None:
    """Nothing after a request's final event, and a StatsReport never counts a token not yet sent."""
    finals, tokens_sent = set(), 0
    for message in messages:
        if isinstance(message, StepOutputs):
            for event in message.events:
                assert event.request_id not in finals, f"event after the end of {event.request_id}"
                tokens_sent += len(event.token_ids)
                if event.finish_reason is not None:
                    finals.add(event.request_id)
        elif isinstance(message, StatsReport):
            assert message.stats.generated_tokens <= tokens_sent, "stats sent before the events they count"


def mixed_requests() -> list[GenerateRequest]:
    """Greedy, seeded sampling, top-n, prompt logprobs, stop ids, EOS: every way a request ends."""
    requests = []
    for i, prompt in enumerate(prompts(24, length=9)):
        kind = i % 4
        requests.append(
            GenerateRequest(
                f"r{i}",
                prompt,
                SamplingParams(do_sample=kind == 1, temperature=0.8, seed=i, top_n_tokens=2 if kind == 2 else 0),
                max_new_tokens=4 + i % 7,
                stop_token_ids=[17, 40] if kind == 3 else [],
                ignore_eos=kind == 0,
                prompt_logprobs=kind == 2,
            )
        )
    return requests


def run_wire_scenario(tiny_llama_dir: str, overlap: bool):
    config = EngineConfig(
        model_id=tiny_llama_dir, max_batch_total_tokens=2048, max_running_requests=8,
        max_batch_prefill_tokens=16, overlap_host_io=overlap,
    )  # fmt: skip
    engine = WireEngine(config)
    try:
        requests = mixed_requests()
        for request in requests:
            engine.send(AddRequest(request))
        engine.events_until(finished(*(r.request_id for r in requests)))
        batch_report = engine.idle_report()

        engine.send(AddRequest(GenerateRequest("long", [5, 6, 7], max_new_tokens=500, ignore_eos=True)))
        engine.events_until(lambda events: len(events.get("long", [])) >= 2)
        engine.send(AddRequest(GenerateRequest("late", [9, 8, 7, 6], max_new_tokens=12, ignore_eos=True)))
        engine.events_until(finished("late"))
        long_was_running = not finished("long")(engine.events())
        engine.send(AbortRequest("long"))
        engine.events_until(finished("long"))
        abort_report = engine.idle_report()
        return engine.events(), engine.messages, batch_report, abort_report, long_was_running
    finally:
        engine.close()


@pytest.fixture(scope="module")
def wire_runs(tiny_llama_dir):
    return {overlap: run_wire_scenario(tiny_llama_dir, overlap) for overlap in (False, True)}


def test_overlapped_engine_sends_the_same_events_as_the_plain_loop(wire_runs):
    plain, overlapped = wire_runs[False][0], wire_runs[True][0]
    assert sorted(plain) == sorted(overlapped)
    for request_id in plain:
        if request_id == "long":
            continue  # aborted at a time-dependent length
        ours, theirs = overlapped[request_id], plain[request_id]
        assert [(e.token_ids, e.finish_reason, e.seed, e.num_prompt_tokens) for e in ours] == [
            (e.token_ids, e.finish_reason, e.seed, e.num_prompt_tokens) for e in theirs
        ], request_id
        logprobs = [lp for e in theirs for lp in e.logprobs]
        assert [lp for e in ours for lp in e.logprobs] == pytest.approx(logprobs, abs=1e-4)
        assert [[t.token_id for top in e.top_tokens for t in top] for e in ours] == [
            [t.token_id for top in e.top_tokens for t in top] for e in theirs
        ]
        assert (ours[0].prompt_logprobs is None) == (theirs[0].prompt_logprobs is None)
    reasons = {e[-1].finish_reason for e in overlapped.values()}
    assert {"length", "abort"} <= reasons and len(reasons) >= 3, reasons  # EOS or stop ids were hit too


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_wire_order_and_idle_flush(wire_runs, overlap):
    events, messages, batch_report, abort_report, _ = wire_runs[overlap]
    check_wire_order(messages)  # idle flushes are implied: every final event arrived unasked
    assert batch_report.stats.kv_used == 0
    for request_id, request_events in events.items():
        assert [e.finish_reason is not None for e in request_events].count(True) == 1, request_id


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_request_added_mid_generation_is_served_and_an_abort_frees_the_pool(wire_runs, overlap):
    events, _, _, abort_report, long_was_running = wire_runs[overlap]
    assert long_was_running and events["late"][-1].finish_reason == "length" and len(tokens_of(events["late"])) == 12
    assert events["long"][-1].finish_reason == "abort" and len(tokens_of(events["long"])) < 500
    plain_long, long_tokens = tokens_of(wire_runs[False][0]["long"]), tokens_of(events["long"])
    assert long_tokens[: len(plain_long)] == plain_long[: len(long_tokens)]
    assert abort_report.stats.kv_used == 0 and abort_report.stats.running == 0


# ---- through the real client, with SmolLM2 ------------------------------------------------------
async def test_overlapped_engine_process_serves_32_concurrent_requests_and_aborts(smollm2_greedy):
    client = await ZmqEngineClient.start(smollm2_engine_config(overlap_host_io=True))
    try:
        requests = [
            GenerateRequest(f"r{i}", prompt, max_new_tokens=SMOLLM2_MAX_NEW, ignore_eos=True)
            for i, prompt in enumerate(SMOLLM2_PROMPTS[i % len(SMOLLM2_PROMPTS)] for i in range(32))
        ]

        async def collect(request):
            return [event async for event in client.generate(request)]

        outputs = await asyncio.gather(*(collect(r) for r in requests))
        for i, events in enumerate(outputs):
            assert tokens_of(events) == smollm2_greedy[i % len(SMOLLM2_PROMPTS)], f"request {i}"
            assert [e.finish_reason for e in events] == [None] * (SMOLLM2_MAX_NEW - 1) + ["length"]
            assert events[0].num_prompt_tokens == len(SMOLLM2_PROMPTS[i % len(SMOLLM2_PROMPTS)])

        stream = client.generate(GenerateRequest("long", SMOLLM2_PROMPTS[0], max_new_tokens=2000, ignore_eos=True))
        assert tokens_of([await stream.__anext__()]) == smollm2_greedy[0][:1]
        await stream.aclose()  # aborts
        client.latest_stats = None
        deadline = time.monotonic() + 60
        while not (client.latest_stats and client.latest_stats.running == 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert client.latest_stats.kv_used == 0 and client.latest_stats.queue_size == 0
        assert await client.check_health()
    finally:
        await client.shutdown()
