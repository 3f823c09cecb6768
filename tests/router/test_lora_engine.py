"""LoRA through the real engine on the embedded SmolLM2: adapters in batches beside base rows (alone, batched,
chunked with overlap scheduling, more adapters than slots), the prefix cache keyed by adapter, and adapters
loaded, unloaded, unknown and malformed while it serves."""

from __future__ import annotations

import dataclasses
import time

import pytest
from smollm2_cases import SMOLLM2_PROMPTS, smollm2_engine_config

from tests.lora_adapters import write_smollm2_adapter
from tgi_compat.modeling.lora.adapter import LoraAdapterError
from tgi_compat.router.client_api import AdapterCallError, Refusal, RequestRejectedError
from tgi_compat.router.client_in_process import InProcessEngineClient
from tgi_compat.router.config import LoraSource
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.wire import LoadAdapter, UnloadAdapter

MAX_NEW = 4
PROMPT = SMOLLM2_PROMPTS[8] + SMOLLM2_PROMPTS[5]
LOGPROBS: dict[str, list[float]] = {}  # every run's, by request id


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    return {name: write_smollm2_adapter(root / name, rank, seed=10 + i) for i, (name, rank) in enumerate(
        {"a1": 8, "a2": 16, "a3": 16}.items())}  # fmt: skip


@pytest.fixture(scope="module")
def engine(folders) -> EngineCore:
    config = smollm2_engine_config(
        max_loras=2,  # three adapters over two slots: one waits for a slot now and then
        max_cpu_loras=4,
        max_lora_rank=16,
        lora_adapters=[LoraSource(name, str(folder)) for name, folder in folders.items()],
    )
    return EngineCore.from_config(config)


def run(engine: EngineCore, requests: list[tuple[list[int], str | None]], tag: str) -> list[tuple[list[int], int]]:
    """Every (prompt, adapter) at once to completion: (tokens, prompt tokens found cached) in request order."""
    for i, (prompt, adapter) in enumerate(requests):
        engine.add_request(
            GenerateRequest(f"{tag}{i}", prompt, max_new_tokens=MAX_NEW, ignore_eos=True, adapter_id=adapter)
        )
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            LOGPROBS.setdefault(event.request_id, []).extend(event.logprobs)
            cached[event.request_id] = cached.get(event.request_id, 0) + event.num_cached_tokens
    assert engine.pool.num_used_slots == engine.pool.num_shared_slots  # (only the cache holds slots)
    return [(tokens[f"{tag}{i}"], cached[f"{tag}{i}"]) for i in range(len(requests))]


@pytest.fixture(scope="module")
def alone(engine) -> dict[str | None, list[int]]:
    engine.pool.flush_prefix_cache()
    return {
        adapter: run(engine, [(SMOLLM2_PROMPTS[0], adapter)], f"alone-{adapter}-")[0][0]
        for adapter in (None, "a1", "a2", "a3")
    }


def test_adapters_change_the_answer(alone):
    assert len({tuple(tokens) for tokens in alone.values()}) > 1
    base = LOGPROBS["alone-None-0"]
    for adapter in ("a1", "a2", "a3"):
        assert max(abs(a - b) for a, b in zip(LOGPROBS[f"alone-{adapter}-0"], base)) > 1e-2, adapter


@pytest.mark.parametrize("chunked_overlapped", [False, True], ids=["plain", "overlap-chunked"])
def test_mixed_batches_equal_each_row_alone(engine, alone, chunked_overlapped):
    limits = engine.scheduler.limits
    if chunked_overlapped:  # prompts in 3-token chunks beside decodes, the next step scheduled before the last ends
        engine.overlap_scheduling = True
        engine.scheduler.limits = dataclasses.replace(limits, max_batch_prefill_tokens=3)
    try:
        adapters = [None, "a1", "a2", "a3", "a1", None, "a3", "a2"]
        outputs = run(engine, [(SMOLLM2_PROMPTS[0], a) for a in adapters], f"mixed-{chunked_overlapped}-")
        assert [tokens for tokens, _ in outputs] == [alone[a] for a in adapters]
    finally:
        engine.overlap_scheduling, engine.scheduler.limits = False, limits


def test_prefix_cache_is_keyed_by_adapter(engine):
    engine.pool.flush_prefix_cache()
    ((_, first),) = run(engine, [(PROMPT, None)], "pc-base-")
    ((_, under_a1),) = run(engine, [(PROMPT, "a1")], "pc-a1-")
    ((_, again_a1),) = run(engine, [(PROMPT, "a1")], "pc-a1-again-")
    ((_, under_a2),) = run(engine, [(PROMPT, "a2")], "pc-a2-")
    assert first == 0 and under_a1 == 0 and under_a2 == 0
    assert again_a1 == len(PROMPT) - 1


def test_unknown_malformed_load_and_unload(engine, folders, tmp_path, alone):
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_request(GenerateRequest("unknown", [1, 2], adapter_id="nope"))
    assert (refused.value.reason, refused.value.values) == (Refusal.UNKNOWN_ADAPTER, ("nope", "a1", "a2", "a3"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": true}')
    with pytest.raises(LoraAdapterError, match="use_dora"):
        engine.load_adapter("broken", str(broken))
    big = write_smollm2_adapter(tmp_path / "big", 32, seed=3)
    with pytest.raises(LoraAdapterError, match="rank 32 > --max-lora-rank 16"):
        engine.load_adapter("big", str(big))
    # a request of a1 is queued when a1 is unloaded: it still finishes under a1; new ones are refused
    engine.add_request(
        GenerateRequest("before-unload", SMOLLM2_PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True, adapter_id="a1")
    )
    engine.unload_adapter("a1")
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_request(GenerateRequest("after-unload", [1, 2], adapter_id="a1"))
    assert refused.value.values == ("a1", "a2", "a3")
    tokens: list[int] = []
    while engine.has_unfinished():
        for event in engine.step():
            tokens += event.token_ids
    assert tokens == alone["a1"]
    engine.load_adapter("a1-again", str(folders["a1"]))
    assert run(engine, [(SMOLLM2_PROMPTS[0], "a1-again")], "reloaded-")[0][0] == alone["a1"]
    assert run(engine, [(SMOLLM2_PROMPTS[0], None)], "base-after-")[0][0] == alone[None]


def test_loads_and_unloads_while_serving_through_adapter_calls(engine, folders, tmp_path, alone):
    """What the engine loop does with LoadAdapter / UnloadAdapter: a load's files are read in a thread while
    steps go on, then it is installed between two steps; every reply names the adapters loaded then."""
    calls = engine.adapter_calls
    engine.add_request(GenerateRequest("during-load", SMOLLM2_PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True))
    assert calls.submit(LoadAdapter(1, "late", str(folders["a2"]))) is None  # being read: no answer yet
    tokens, replies = [], []
    while engine.has_unfinished() or calls.num_reading:
        for event in engine.step():
            tokens += event.token_ids
        replies += calls.take_replies()
    assert tokens == alone[None]
    assert [(r.call_id, r.error) for r in replies] == [(1, None)]
    assert replies[0].adapters == {**{n: str(folders[n]) for n in ("a2", "a3")}, "a1-again": str(folders["a1"]),
                                   "late": str(folders["a2"])}  # fmt: skip
    assert run(engine, [(SMOLLM2_PROMPTS[0], "late")], "late-")[0][0] == alone["a2"]
    # answered at once: a taken name, an unload, an unknown adapter
    taken = calls.submit(LoadAdapter(2, "late", str(folders["a1"])))
    assert taken is not None and taken.error == "LoRA adapter 'late' is already loaded" and not taken.not_found
    unloaded = calls.submit(UnloadAdapter(3, "late"))
    assert unloaded is not None and unloaded.error is None and "late" not in unloaded.adapters
    unknown = calls.submit(UnloadAdapter(4, "late"))
    assert unknown is not None and unknown.not_found and "loaded: a2, a3, a1-again" in (unknown.error or "")
    # refused after reading: a malformed folder (400), a path with nothing there (404)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    for call_id, source in ((5, str(broken)), (6, str(tmp_path / "missing"))):
        assert calls.submit(LoadAdapter(call_id, f"bad{call_id}", source)) is None
    while calls.num_reading:
        time.sleep(0.01)
        replies = [*replies, *calls.take_replies()]
    (malformed, missing) = replies[-2:]
    assert "is not valid JSON" in (malformed.error or "") and not malformed.not_found
    assert "no such folder" in (missing.error or "") and missing.not_found
    assert set(missing.adapters) == {"a2", "a3", "a1-again"}


def test_a_load_in_place_gives_new_requests_the_new_weights_and_running_ones_the_old(engine, folders, alone):
    """vLLM's load_inplace: a2 replaced by a3's files while a request of a2 runs; it finishes on a2's weights, a
    request that comes after gets a3's answer under the name a2; the host cache holds both until it ends."""
    calls = engine.adapter_calls
    assert alone["a2"] != alone["a3"]
    engine.add_request(
        GenerateRequest("before-replace", SMOLLM2_PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True, adapter_id="a2")
    )
    tokens = [t for event in engine.step() for t in event.token_ids]  # running
    assert calls.submit(LoadAdapter(20, "a2", str(folders["a3"]), replace=True)) is None
    replies = []
    while not replies:  # installed between two steps of the running request
        time.sleep(0.01)
        replies += calls.take_replies()
    assert engine.lora is not None and len(engine.lora.manager.adapters) == 4  # the old host copy kept for it
    while engine.has_unfinished():
        for event in engine.step():
            tokens += event.token_ids
    assert tokens == alone["a2"]
    assert [(r.call_id, r.error) for r in replies] == [(20, None)] and replies[0].adapters["a2"] == str(folders["a3"])
    assert run(engine, [(SMOLLM2_PROMPTS[0], "a2")], "after-replace-")[0][0] == alone["a3"]
    taken = calls.submit(LoadAdapter(21, "a2", str(folders["a2"])))  # without replace: the name is taken
    assert taken is not None and taken.error == "LoRA adapter 'a2' is already loaded"
    engine.load_adapter("a2", str(folders["a2"]), replace=True)  # back, for the tests after
    assert run(engine, [(SMOLLM2_PROMPTS[0], "a2")], "restored-")[0][0] == alone["a2"]


def test_stats_name_the_running_and_waiting_adapters(engine):
    """vllm:lora_requests_info's labels: two adapters hold the two slots, the third waits for one."""
    for adapter in ("a2", "a3", "a1-again"):
        engine.add_request(GenerateRequest(f"stats-{adapter}", [1, 2, 3], max_new_tokens=MAX_NEW, adapter_id=adapter))
    engine.step()
    stats = engine.stats.report(force=True)
    assert stats is not None
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (["a2", "a3"], ["a1-again"])
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats.report(force=True)
    assert stats is not None and (stats.running_lora_adapters, stats.waiting_lora_adapters) == ([], [])


async def test_the_in_process_client_loads_and_unloads(engine, folders):
    """The engine client seam in a thread (InProcessEngineClient): the calls and their errors, typed."""
    client = InProcessEngineClient(engine)
    try:
        await client.load_adapter("via-client", str(folders["a3"]))
        assert client.lora_adapters["via-client"] == str(folders["a3"])
        with pytest.raises(AdapterCallError, match="'via-client' is already loaded") as taken:
            await client.load_adapter("via-client", str(folders["a1"]))
        assert not taken.value.not_found
        await client.unload_adapter("via-client")
        assert "via-client" not in client.lora_adapters
        with pytest.raises(AdapterCallError, match="'via-client' is not loaded") as unknown:
            await client.unload_adapter("via-client")
        assert unknown.value.not_found
    finally:
        await client.shutdown()


@pytest.mark.parametrize("room", [False, True], ids=["at-the-cap", "room-for-one"])
def test_a_late_adapter_request_waits_only_for_the_running_cap(engine, room):
    """benchmarks/device/lora.py's late request (a first token 2.6 s after its adapter was ready): the engine
    admits an adapter's request beside the running ones as soon as a slot of it is free, and only
    --max-batch-size (max_running_requests) makes it wait, for a running request to finish."""
    limits = engine.scheduler.limits
    admission = dataclasses.replace(limits.admission, max_running_requests=2 + room)
    engine.scheduler.limits = dataclasses.replace(limits, admission=admission)
    try:
        for i in range(2):
            engine.add_request(
                GenerateRequest(f"cap-{room}-{i}", SMOLLM2_PROMPTS[i], max_new_tokens=3 * MAX_NEW, ignore_eos=True)
            )
        engine.step()
        engine.add_request(
            GenerateRequest(f"cap-{room}-late", [1, 2, 3], max_new_tokens=MAX_NEW, ignore_eos=True, adapter_id="a3")
        )
        finished: set[str] = set()
        first_late_token_after: set[str] | None = None
        while engine.has_unfinished():
            for event in engine.step():
                if event.request_id.endswith("late") and event.token_ids and first_late_token_after is None:
                    first_late_token_after = set(finished)
                if event.finish_reason is not None:
                    finished.add(event.request_id)
        assert first_late_token_after == (set() if room else {f"cap-{room}-0", f"cap-{room}-1"})
    finally:
        engine.scheduler.limits = limits
