"""Mllama through the real engine (scheduler, batch builder, encoder cache, cross-attention store, the transformers
fallback's runner) on a tiny random checkpoint: the text cross-attends to its images' keys, made once per request.
Greedy ids equal transformers' `generate` for one image (tokens before it too), for three (two of them back to back)
beside a text-only request, whole and under 4-token prefill chunks; the KV slots and the image keys are freed when
the requests end."""

from __future__ import annotations

import dataclasses
import io

import pytest
from PIL import Image

from benchmarks.device.steps import engine_tokens
from tests.modeling import mllama_helpers as mllama
from tgi_compat.modeling.config import MLLAMA_EXTRA_EMBEDDING_ROWS
from tgi_compat.modeling.models.mllama import MllamaForConditionalGeneration
from tgi_compat.modeling.models.transformers_fallback import fallback_model_config
from tgi_compat.modeling.registry import describe_modeling_path
from tgi_compat.modeling.vision.cross_keys import CROSS_KEYS_SHARE, CrossAttentionKeys, cross_attention_keys
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' tiny Mllama, an engine of it on the CPU by its prefill budget)."""
    model, folder = mllama.saved_mllama(tmp_path_factory.mktemp("mllama-engine"))

    def engine(prefill: int = 4096) -> EngineCore:
        config = EngineConfig(model_id=folder, device="cpu", dtype="float32", max_batch_prefill_tokens=prefill)
        return EngineCore.from_config(config)

    return model, engine


def test_one_image_equals_transformers_generate(checkpoint):
    model, make_engine = checkpoint
    engine = make_engine()
    out = engine_tokens(engine, [mllama.engine_request("one", mllama.ONE, [mllama.WIDE])])
    assert out["one"] == mllama.generate_ids(model, mllama.ONE, [mllama.WIDE], mllama.NEW)
    assert engine.cross_attention is not None and len(engine.cross_attention) == 0  # freed as it ended
    assert engine.pool.is_full_free()


@pytest.mark.parametrize("prefill", [4096, 4], ids=["whole", "chunked"])
def test_images_beside_a_text_request_equal_each_alone(checkpoint, prefill):
    model, make_engine = checkpoint
    engine = make_engine(prefill)
    store = engine.cross_attention
    assert store is not None
    held = []

    def drain(requests):
        for request in requests:
            engine.add_request(request)
        first = engine.step()  # the image request's first chunk: its keys are made
        held.append(store.nbytes)
        rest = engine_tokens(engine, [])
        return {
            r.request_id: [t for e in first if e.request_id == r.request_id for t in e.token_ids]
            + rest.get(r.request_id, [])
            for r in requests
        }

    mllama.check_images_beside_text(model, drain)
    # 3 images x 4 tiles x 5 patches, keys and values of 2 KV heads x 16 of both cross layers, in fp32
    assert held == [3 * mllama.MAX_TILES * 5 * 2 * (2 * 16) * 2 * 4] == [3 * store.projector.image_kv_bytes]
    assert store.nbytes == 0 and len(store) == 0 and engine.pool.is_full_free()
    assert store.images.num_encoded == 2  # WIDE once


def test_image_keys_wait_for_room(checkpoint):
    """Room for 2 images' keys (on a GPU, CROSS_KEYS_SHARE of the KV cache's memory): the 3-image request starts
    alone, the 1-image one waits for it to end (and the text one behind it, first come first served), and every
    answer is still transformers'."""
    model, make_engine = checkpoint
    engine = make_engine()
    engine.scheduler.limits = dataclasses.replace(engine.scheduler.limits, max_cross_images=2)
    store = engine.cross_attention
    assert store is not None
    requests = [
        mllama.engine_request("three", mllama.THREE, [mllama.WIDE, mllama.TALL, mllama.WIDE]),
        mllama.engine_request("one", mllama.ONE, [mllama.TALL]),
        mllama.engine_request("text", mllama.TEXT, []),
    ]
    for request in requests:
        engine.add_request(request)
    out: dict[str, list[int]] = {}
    holders = set()
    while engine.has_unfinished():
        for event in engine.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)
        holders.add(len(store))
    assert holders == {0, 1}  # never both image requests' keys at once
    for request, images in zip(requests, [[mllama.WIDE, mllama.TALL, mllama.WIDE], [mllama.TALL], []]):
        assert out[request.request_id] == mllama.generate_ids(model, request.prompt_ids, images, mllama.NEW)


def test_room_for_image_keys_is_a_share_of_the_kv_budget(checkpoint):
    model, _ = checkpoint
    config = fallback_model_config(model.config.to_dict() | {"architectures": ["MllamaForConditionalGeneration"]})
    ours = MllamaForConditionalGeneration(config)
    per_image = mllama.MAX_TILES * 5 * 2 * (2 * 16) * 2 * 4  # fp32 keys and values, both cross layers
    assert ours.image_kv_bytes == per_image
    keys = cross_attention_keys(config, ours, per_image * 10 / CROSS_KEYS_SHARE)
    assert keys is not None and keys.max_images == 10 and keys.reserved_bytes == 10 * per_image
    assert cross_attention_keys(config, ours, None) == CrossAttentionKeys(ours)  # CPU, or a fixed KV size
    assert cross_attention_keys(dataclasses.replace(config, multimodal_architecture=None), ours, 1e9) is None


def test_tiles_config_and_path(checkpoint):
    """The tiles the API counts are the processor's; only the self-attention layers take paged KV; `<|image|>` is a
    prompt token past the logits' vocabulary."""
    model, _ = checkpoint
    for data, tiles in [(mllama.WIDE, 4), (mllama.TALL, 3)]:
        width, height = Image.open(io.BytesIO(data)).size
        assert mllama.TOKENS.tiles(height, width) == tiles
        assert mllama.image_processor()(images=[[Image.open(io.BytesIO(data))]])["num_tiles"] == [[tiles]]
    d = model.config.to_dict() | {"architectures": ["MllamaForConditionalGeneration"]}
    config = fallback_model_config(d)
    assert (config.num_layers, config.vocab_size, config.multimodal_architecture) == (
        2,
        mllama.IMAGE + MLLAMA_EXTRA_EMBEDDING_ROWS,
        "MllamaForConditionalGeneration",
    )
    assert describe_modeling_path("MllamaForConditionalGeneration") == (
        "transformers modeling of its text model and vision encoder"
    )
