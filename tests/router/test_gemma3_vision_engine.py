"""A Gemma 3 vision request through the real engine (scheduler, batch builder, encoder cache, runner) on a tiny
random checkpoint: greedy ids equal transformers' generate with the same pixels; the same image again is
encoded once and hits the prefix cache; a different image neither."""

from __future__ import annotations

import hashlib
import io

import pytest
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from tests.modeling.helpers import image_greedy
from tests.modeling.test_gemma3_multimodal import tiny_multimodal
from tests.router.router_fakes import drain_events
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.images import PromptImage
from tgi_compat.router.request import GenerateRequest

VOCAB, PER_IMAGE, NEW = 300, 4, 8
IMAGE, BOI, EOI = VOCAB - 1, VOCAB - 3, VOCAB - 2


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    picture = Image.new("RGB", size, color)
    picture.putpixel((1, 2), (255, 255, 0))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


RED, GREEN = png((200, 30, 60), (40, 30)), png((10, 220, 90), (33, 50))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_multimodal(VOCAB)
    folder = tmp_path_factory.mktemp("gemma3-vision-engine")
    model.save_pretrained(folder)
    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor.save_pretrained(folder)
    return model, processor, str(folder)


def make_engine(folder: str, **limits) -> EngineCore:
    config = EngineConfig(model_id=folder, device="cpu", dtype="float32", max_batch_total_tokens=1024, **limits)
    return EngineCore.from_config(config)


def request(request_id: str, images: list[bytes]) -> tuple[GenerateRequest, list[int]]:
    ids, spans = [5, 6, 7], []
    for k, data in enumerate(images):
        ids += [BOI]
        spans.append(PromptImage(len(ids), PER_IMAGE, hashlib.sha256(data).hexdigest(), data, bidirectional=True))
        ids += [IMAGE] * PER_IMAGE + [EOI, 10 + k, 11 + k]
    return GenerateRequest(request_id, ids, max_new_tokens=NEW, ignore_eos=True, images=spans), ids


def run(engine: EngineCore, *requests: GenerateRequest) -> dict[str, list]:
    return drain_events(engine, requests)


def token_ids(events) -> list[int]:
    return [t for event in events for t in event.token_ids]


def expected(checkpoint, ids: list[int], images: list[bytes]) -> list[int]:
    model, processor, _ = checkpoint
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    pixel_values = processor(images=pictures, return_tensors="pt")["pixel_values"]
    return image_greedy(model, ids, pixel_values, NEW)


@pytest.mark.parametrize("prefill", [4096, 11, 6], ids=["whole", "chunked", "image-sized"])
def test_greedy_ids_equal_transformers_with_two_images(checkpoint, prefill):
    """Whole prompts in one step, and prefill in steps of at most 11 and 6 tokens (chunks that would split
    an image end before it: its placeholders attend to each other both ways)."""
    engine = make_engine(checkpoint[2], max_batch_prefill_tokens=prefill)
    both, ids = request("both", [RED, GREEN])
    red, red_ids = request("red", [RED])
    events = run(engine, both, red)
    assert token_ids(events["both"]) == expected(checkpoint, ids, [RED, GREEN])
    assert token_ids(events["red"]) == expected(checkpoint, red_ids, [RED])


def test_the_same_image_is_encoded_once_and_hits_the_prefix_cache(checkpoint):
    engine = make_engine(checkpoint[2])
    cache = engine.executor.batch_builder.images
    assert cache is not None
    first, ids = request("first", [RED])
    run(engine, first)
    again = run(engine, request("again", [RED])[0])
    green = run(engine, request("green", [GREEN])[0])
    assert again["again"][0].num_cached_tokens == len(ids) - 1
    assert green["green"][0].num_cached_tokens == 4  # the text before the image only
    assert cache.num_encoded == 2 and len(cache) == 2
    assert token_ids(again["again"]) == expected(checkpoint, ids, [RED])
