"""A Qwen2.5-VL (and Qwen2-VL) request through the real engine (scheduler, batch builder, encoder cache, runner, M-RoPE positions
per request) on a tiny random checkpoint: greedy ids equal transformers' generate, whole and under chunked prefill
(chunks may end inside an image: its placeholders attend causally), beside a text-only request in the same steps,
with and without overlap scheduling; a repeated image is encoded once and hits the prefix cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
from router_fakes import drain_events

from tests.modeling.qwen2_5_vl_helpers import (
    ENGINE_VOCAB,
    FAMILIES,
    TALL,
    WIDE,
    check_two_images_beside_text,
    engine_expected,
    engine_request,
    saved_qwen2_5_vl,
)
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import SamplingParams


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp(f"{request.param}-engine")
    return saved_qwen2_5_vl(folder, ENGINE_VOCAB, request.param), str(folder)


def make_engine(folder: str, **limits) -> EngineCore:
    config = EngineConfig(model_id=folder, device="cpu", dtype="float32", max_batch_total_tokens=1024, **limits)
    return EngineCore.from_config(config)


def token_ids(events) -> list[int]:
    return [t for event in events for t in event.token_ids]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_equal_transformers_with_two_images(checkpoint, prefill, overlap):
    model, folder = checkpoint
    engine = make_engine(folder, max_batch_prefill_tokens=prefill, overlap_scheduling=overlap)

    def drain(requests) -> dict[str, list[int]]:
        return {request_id: token_ids(events) for request_id, events in drain_events(engine, requests).items()}

    check_two_images_beside_text(model, drain)


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)  # the engine's path, not the family's
def test_the_same_image_is_encoded_once_and_hits_the_prefix_cache(checkpoint):
    model, folder = checkpoint
    engine = make_engine(folder)
    cache = engine.executor.batch_builder.images
    assert cache is not None
    first, ids = engine_request("first", [WIDE])
    drain_events(engine, [first])
    again = drain_events(engine, [engine_request("again", [WIDE])[0]])
    tall = drain_events(engine, [engine_request("tall", [TALL])[0]])
    assert again["again"][0].num_cached_tokens == len(ids) - 1
    assert tall["tall"][0].num_cached_tokens == 4  # the text before the image only
    assert cache.num_encoded == 2
    assert token_ids(again["again"]) == engine_expected(model, ids, [WIDE])


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)
@pytest.mark.parametrize("images", [[WIDE], []], ids=["image", "text"])
def test_a_launch_with_image_rows_calls_back_before_its_forward(checkpoint, images):
    """StepExecutor.launch's `after_images`: called once the inputs hold image rows (the encoder queued), before the
    forward is queued; not for a text-only step."""
    _, folder = checkpoint
    engine = make_engine(folder, overlap_scheduling=True)
    engine.add_request(engine_request("r", images)[0])
    cache = engine.executor.batch_builder.images
    assert cache is not None
    calls: list[int] = []
    engine.executor.launch(engine.scheduler.schedule(), None, after_images=lambda: calls.append(cache.num_encoded))
    assert calls == [1] * len(images)  # once, after the image was encoded


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)
def test_a_step_whose_image_rows_are_all_cached_overlaps_as_text_does(checkpoint):
    """An image cut across two chunks: the step of its first chunk encodes it and calls `after_images`; the next
    step's rows all come from the encoder cache, nothing is queued ahead of its forward, and it does not call back
    (its previous step then completes after its launch, as a text step's does)."""
    _, folder = checkpoint
    request, _ = engine_request("r", [WIDE])
    image = request.images[0]
    engine = make_engine(folder, max_batch_prefill_tokens=image.offset + 2, overlap_scheduling=True)
    cache = engine.executor.batch_builder.images
    assert cache is not None
    launch, calls, image_steps = engine.executor.launch, [], []

    def recorded(plan, previous, **options):
        after = options["after_images"]

        def noted() -> None:
            calls.append(cache.num_encoded)
            after()

        image_steps.append(any(c.start < image.end and c.end > image.offset for c in plan.chunks))
        return launch(plan, previous, **(options | {"after_images": noted}))

    engine.executor.launch = recorded
    drain_events(engine, [request])
    assert calls == [1]  # the first chunk's step alone
    assert image_steps[:2] == [True, True] and cache.num_encoded == 1


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)
def test_seeded_sampling_with_images_arriving_while_others_decode_is_the_same_with_overlap(checkpoint):
    """Under overlap a step whose chunks bring images completes the step before it once their encoding is queued and
    before its forward (tgi_compat/router/engine.py): the sampled ids, seeded, equal the plain engine's."""
    _, folder = checkpoint
    outputs = {}
    for overlap in (False, True):
        engine = make_engine(folder, max_batch_prefill_tokens=7, overlap_scheduling=overlap)
        ids: dict[str, list[int]] = {}
        arrivals = [(0, "first", [WIDE]), (3, "second", [TALL]), (5, "third", [WIDE, TALL]), (6, "text", [])]
        step = 0
        while arrivals or engine.has_unfinished():
            while arrivals and arrivals[0][0] <= step:
                _, name, images = arrivals.pop(0)
                request, _ = engine_request(name, images)
                request.sampling = SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=len(name))
                engine.add_request(request)
            for event in engine.step():
                ids.setdefault(event.request_id, []).extend(event.token_ids)
            step += 1
        outputs[overlap] = ids
    assert outputs[True] == outputs[False] and len(outputs[True]) == 4


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)
def test_the_encoder_caches_bytes_are_left_out_of_the_kv_budget(checkpoint):
    from tgi_compat.router.model_loading import load_runner

    _, folder = checkpoint
    engine = make_engine(folder, image_cache_bytes=3 << 20)
    assert engine.image_cache is not None and engine.image_cache.max_bytes == 3 << 20
    config = EngineConfig(model_id=folder, device="cpu", dtype="float32", max_batch_total_tokens=1024)
    reserved = [load_runner(replace(config, image_cache_bytes=size))._activation_reserve_bytes() for size in (1, 3)]
    assert reserved[1] - reserved[0] == 2
