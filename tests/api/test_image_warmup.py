"""A vision model's start-up warm-up runs its image path (tgi_compat/api/server/warmup.py, warm_up_images): an image
prompt made by the API's own image expansion goes through the real engine on a tiny Qwen2.5-VL checkpoint and
finishes; none is sent where one would not fit --max-input-tokens, or where --max-images is 0."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.modeling.qwen2_5_vl_helpers import IMAGE_TOKENS, image_processor, tiny_qwen2_5_vl
from tests.modeling.vision_server import write_checkpoint
from tgi_compat.api.server.warmup import warm_up_images
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import VisionPrompts
from tgi_compat.api.serving.tokenization import load_tokenizer_service
from tgi_compat.modeling.source import resolve_model_source
from tgi_compat.modeling.weights.loader import load_model_config
from tgi_compat.router.client_in_process import InProcessEngineClient
from tgi_compat.router.config import EngineConfig


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl-warmup")
    write_checkpoint(folder, IMAGE_TOKENS, IMAGE_TOKENS[3], tiny_qwen2_5_vl, image_processor())
    return str(folder)


@pytest.fixture
async def engine(folder):
    client = await InProcessEngineClient.start(EngineConfig(model_id=folder, device="cpu", dtype="float32"))
    yield client
    await client.shutdown()


def vision_prompts(folder: str, max_images: int | None = None) -> VisionPrompts:
    vision = VisionPrompts.of(load_model_config(resolve_model_source(folder)), ImageFetcher(), folder, max_images)
    assert vision is not None
    return vision


async def test_a_vision_model_warms_its_image_path_up(folder, engine):
    tokenizer = load_tokenizer_service(folder)
    assert await warm_up_images(engine, vision_prompts(folder), tokenizer, 4096, 8) == 1
    assert engine.core.image_cache is not None and engine.core.image_cache.num_encoded == 1  # its image was encoded


async def test_no_image_prompt_where_one_cannot_be_sent(folder, engine):
    tokenizer = load_tokenizer_service(folder)
    assert await warm_up_images(engine, vision_prompts(folder), tokenizer, 8, 8) == 0  # past --max-input-tokens
    assert await warm_up_images(engine, replace(vision_prompts(folder), max_images=0), tokenizer, 4096, 8) == 0
