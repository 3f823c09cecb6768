"""LLaVA-Next through the real engine (scheduler, batch builder, encoder cache, the transformers fallback's runner)
on a tiny random checkpoint: greedy ids equal transformers' with two images beside a text-only request in the same
steps, whole and under 7-token prefill chunks (each cuts an image's placeholder run); a repeated image is encoded
once. The same check runs on the device in tests/gpu/test_llava_next_gpu.py."""

from __future__ import annotations

import pytest

from benchmarks.device.steps import engine_tokens
from tests.modeling.llava_next_helpers import WIDE, check_images_beside_text, engine_request, saved_llava_next
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return saved_llava_next(tmp_path_factory.mktemp("llava-next-engine"))


@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_equal_transformers_with_two_images(checkpoint, prefill):
    model, folder = checkpoint
    config = EngineConfig(model_id=folder, device="cpu", dtype="float32", max_batch_prefill_tokens=prefill)
    engine = EngineCore.from_config(config)
    check_images_beside_text(model, lambda requests: engine_tokens(engine, requests))


def test_a_repeated_image_is_encoded_once(checkpoint):
    model, folder = checkpoint
    engine = EngineCore.from_config(EngineConfig(model_id=folder, device="cpu", dtype="float32"))
    first = engine_tokens(engine, [engine_request(model, "first", [WIDE])[0]])
    again = engine_tokens(engine, [engine_request(model, "again", [WIDE])[0]])
    assert first["first"] == again["again"]
    assert engine.executor.batch_builder.images is not None and engine.executor.batch_builder.images.num_encoded == 1
