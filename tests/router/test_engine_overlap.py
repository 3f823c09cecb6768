"""Overlap scheduling (EngineConfig.overlap_scheduling): step N+1 is scheduled and launched before
step N's tokens are read back.

On a GPU the launch returns at once and the host work hides behind the GPU; on CPU the forward is
synchronous, which is slower but runs the same bookkeeping (pending tokens fed to the next step on
the device, finished requests dropped one step late), so these tests force it on and check it
against the plain engine: same tokens, logprobs, seeds and finish reasons, every slot freed.
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
from router_fakes import HashRunner, drain, hash_engine
from smollm2_cases import SMOLLM2_MAX_NEW, SMOLLM2_PROMPTS, smollm2_engine_config
from test_engine import expected_greedy, prompts, tokens_of

from tgi_compat.router.client import ZmqEngineClient
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine_process import run_engine_process
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest, SamplingParams
from tgi_compat.router.sampling.output import SampledRows
from tgi_compat.router.wire import (
    AbortRequest,
    AddRequest,
    Ready,
    Shutdown,
    StatsReport,
    StepOutputs,
    encoder,
    engine_message_decoder,
)


# ---- EngineCore over the stand-in model ---------------------------------------------------------
def every_kind_of_request(temperature: float = 1.5, one_token_request: int | None = 5) -> list[GenerateRequest]:
    """Greedy, seeded sampling, top-n, prompt logprobs, stop ids, EOS: every way a request ends; request
    `one_token_request` asks for a single token."""
    requests = []
    for i, prompt in enumerate(prompts(24, length=9)):
        kind = i % 4
        requests.append(
            GenerateRequest(
                f"r{i}",
                prompt,
                SamplingParams(
                    do_sample=kind == 1, temperature=temperature, seed=i, top_n_tokens=2 if kind == 2 else 0
                ),
                max_new_tokens=1 if i == one_token_request else 4 + i % 7,
                stop_token_ids=[17, 40] if kind == 3 else [],
                ignore_eos=kind == 0,
                prompt_logprobs=kind == 2,
            )
        )
    return requests


def comparable(events: list[TokenEvent]) -> list[tuple]:
    return [
        (
            e.token_ids,
            [round(lp, 4) for lp in e.logprobs],
            [[t.token_id for t in top] for top in e.top_tokens],
            e.finish_reason,
            e.seed,
            e.num_prompt_tokens,
            e.prompt_logprobs,
        )
        for e in events
    ]


def run_engine(overlap: bool, requests: list[GenerateRequest], **engine_kwargs) -> dict[str, list[TokenEvent]]:
    engine = hash_engine(overlap_scheduling=overlap, **engine_kwargs)
    for request in requests:
        engine.add_request(request)
    events = drain(engine)
    assert not engine.has_unfinished() and engine.scheduler.running == [] and not engine.scheduler.waiting
    for request_events in events.values():
        assert [e.finish_reason is not None for e in request_events].count(True) == 1
        assert request_events[-1].finish_reason is not None
    return events


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(),
        dict(max_prefill=5),  # prompts chunked, sharing steps with decodes
        dict(max_running=3),  # queueing: requests join as others finish
        dict(num_kv_slots=90, router_token_ratio=1.0, router_max_new_token_len=1),  # forced preemptions
    ],
    ids=["batched", "chunked", "queued", "preempted"],
)
def test_overlapped_engine_gives_the_plain_engines_events(engine_kwargs):
    plain = run_engine(False, every_kind_of_request(), **engine_kwargs)
    overlapped = run_engine(True, every_kind_of_request(), **engine_kwargs)
    assert sorted(plain) == sorted(overlapped)
    for request_id in plain:
        assert comparable(overlapped[request_id]) == comparable(plain[request_id]), request_id
    reasons = {e[-1].finish_reason for e in overlapped.values()}
    assert {"length", "eos_token", "stop_sequence"} <= reasons, reasons


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_mixed_prefill_budget_changes_the_steps_not_the_events(overlap):
    """--max-mixed-prefill-tokens 2: prompts joining beside decodes advance 2 tokens a step; every request's
    events are those of the default budget, and the pool comes back whole (run_engine checks)."""
    default = run_engine(overlap, every_kind_of_request(), max_running=3)
    mixed = run_engine(overlap, every_kind_of_request(), max_running=3, max_mixed_prefill_tokens=2)
    assert sorted(default) == sorted(mixed)
    for request_id in default:
        assert comparable(mixed[request_id]) == comparable(default[request_id]), request_id


def test_preemptions_happen_in_the_overlapped_run():
    engine = hash_engine(num_kv_slots=90, router_token_ratio=1.0, router_max_new_token_len=1, overlap_scheduling=True)
    for request in every_kind_of_request():
        engine.add_request(request)
    drain(engine)
    assert engine.stats.num_preemptions > 0


def log_forwards_and_reads(engine, monkeypatch) -> list[str]:
    """ "F" for each forward launched, "R" for each step's sampled tokens read on the host, in order."""
    log: list[str] = []
    forward = engine.executor.runner.forward
    monkeypatch.setattr(engine.executor.runner, "forward", lambda batch: (log.append("F"), forward(batch))[1])
    rows = SampledRows.rows
    monkeypatch.setattr(SampledRows, "rows", lambda self: (log.append("R"), rows(self))[1])
    return log


def test_the_next_step_is_launched_before_the_previous_one_is_read(monkeypatch):
    engine = hash_engine(overlap_scheduling=True)
    log = log_forwards_and_reads(engine, monkeypatch)
    prompt = prompts(1)[0]
    engine.add_request(GenerateRequest("a", prompt, max_new_tokens=5))
    assert tokens_of(drain(engine)["a"]) == expected_greedy(prompt, 5)
    # Forward k+1 runs before the tokens of step k are read; the last step is read with nothing after it.
    assert "".join(log) == "F" + "FR" * 4 + "R"


def test_a_request_at_its_length_cap_is_not_scheduled_again():
    # Rows of max_len = 12 positions: a 7-token prompt + 5 new tokens fills its row exactly, so one
    # step past the last token would write position 12, out of the row, and fail the request.
    prompt = prompts(1)[0]
    engine = hash_engine(runner=HashRunner(max_len=len(prompt) + 5), overlap_scheduling=True)
    engine.add_request(GenerateRequest("a", prompt, max_new_tokens=5))
    events = drain(engine)["a"]
    assert tokens_of(events) == expected_greedy(prompt, 5) and events[-1].finish_reason == "length"
    assert engine.executor.runner.num_forwards == 5


def test_a_request_ended_by_a_stop_id_runs_one_dropped_step():
    prompt = prompts(1)[0]
    stop = expected_greedy(prompt, 3)[2]
    engine = hash_engine(overlap_scheduling=True)
    engine.add_request(GenerateRequest("a", prompt, max_new_tokens=20, stop_token_ids=[stop]))
    events = drain(engine)["a"]
    assert tokens_of(events) == expected_greedy(prompt, 3) and events[-1].finish_reason == "stop_sequence"
    assert engine.executor.runner.num_forwards == 4  # the step after the stop id was already launched


def test_requests_that_read_their_own_tokens_turn_overlap_off_while_they_are_in(monkeypatch):
    engine = hash_engine(overlap_scheduling=True)
    log = log_forwards_and_reads(engine, monkeypatch)
    batch = prompts(2)
    penalised = SamplingParams(repetition_penalty=1.3)
    engine.add_request(GenerateRequest("plain", batch[0], max_new_tokens=8))
    first = engine.step() + engine.step()  # overlapping now: one step in flight
    engine.add_request(GenerateRequest("penalised", batch[1], penalised, max_new_tokens=3))
    events = drain(engine)
    assert tokens_of(first + events["plain"]) == expected_greedy(batch[0], 8)
    assert tokens_of(events["penalised"]) == tokens_of(
        run_engine(False, [GenerateRequest("penalised", batch[1], penalised, max_new_tokens=3)])["penalised"]
    )
    steps = "".join(log)
    # F F R (overlapped), then R: drained before the penalised request is scheduled, then plain
    # steps F R while it runs (3 tokens), then overlapped again once it has finished.
    assert steps.startswith("FFR" + "R" + "FR" * 3 + "F"), steps
    assert "FF" in steps[len("FFRR" + "FR" * 3) :], steps
    assert engine.scheduler.num_reading_own_tokens == 0


def test_a_failing_launch_is_retried_and_isolated_while_others_keep_overlapping():
    runner = HashRunner()
    runner.fail_on_token = 0
    engine = hash_engine(runner=runner, overlap_scheduling=True)
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(GenerateRequest(f"ok{i}", prompt, max_new_tokens=6))
    first = engine.step() + engine.step()
    engine.add_request(GenerateRequest("bad", [5, 0, 7], max_new_tokens=4))
    events = drain(engine)
    assert events["bad"][-1].finish_reason == "error" and "poisoned" in events["bad"][-1].error
    for i, prompt in enumerate(prompts(3)):
        ok = [e for e in first if e.request_id == f"ok{i}"] + events[f"ok{i}"]
        assert tokens_of(ok) == expected_greedy(prompt, 6)


def test_an_abort_while_the_requests_token_is_in_flight_ends_it_once_and_frees_its_slots():
    engine = hash_engine(overlap_scheduling=True)
    batch = prompts(2)
    engine.add_request(GenerateRequest("a", batch[0], max_new_tokens=100))
    engine.add_request(GenerateRequest("b", batch[1], max_new_tokens=6))
    events: dict[str, list[TokenEvent]] = {}
    for step in range(4):
        if step == 3:
            engine.abort("a")
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    for request_id, request_events in drain(engine).items():
        events.setdefault(request_id, []).extend(request_events)
    # Steps 1 and 2 delivered two tokens; step 2's launch held a third, dropped by the abort.
    assert [e.finish_reason for e in events["a"]] == [None, None, "abort"]
    assert tokens_of(events["a"]) == expected_greedy(batch[0], 2)
    assert tokens_of(events["b"]) == expected_greedy(batch[1], 6)
    assert engine.pool.is_full_free()


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


def run_wire_scenario(tiny_llama_dir: str, overlap: bool):
    config = EngineConfig(
        model_id=tiny_llama_dir,
        max_batch_total_tokens=2048,
        max_running_requests=8,
        max_batch_prefill_tokens=16,
        overlap_scheduling=overlap,
    )
    engine = WireEngine(config)
    try:
        requests = every_kind_of_request(temperature=0.8, one_token_request=None)
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
    client = await ZmqEngineClient.start(smollm2_engine_config(overlap_scheduling=True))
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
