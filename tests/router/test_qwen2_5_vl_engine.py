"""A Qwen2.5-VL (and Qwen2-VL) request through the real engine (scheduler, batch builder, encoder cache, runner, M-RoPE positions
per request) on a tiny random checkpoint: greedy ids equal transformers' generate, whole and under chunked prefill
(chunks may end inside an image: its placeholders attend causally), beside a text-only request in the same steps,
with and without overlap scheduling; a repeated image is encoded once and hits the prefix cache."""

from __future__ import annotations

import pytest
from test_prefix_cache_engine import drain_events

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
