"""A Qwen2.5-VL request through the real engine (scheduler, batch builder, encoder cache, runner, M-RoPE positions
per request) on a tiny random checkpoint: greedy ids equal transformers' generate, whole and under chunked prefill
(chunks may end inside an image: its placeholders attend causally), beside a text-only request in the same steps,
with and without overlap scheduling; a repeated image is encoded once and hits the prefix cache."""

from __future__ import annotations

import hashlib
import io

import pytest
from PIL import Image
from test_prefix_cache_engine import drain_events

from tests.modeling.qwen2_5_vl_helpers import image_processor, picture, reference_greedy, tiny_qwen2_5_vl
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.images import PromptImage
from tgi_compat.router.request import GenerateRequest

VOCAB, NEW = 300, 8
START, END, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    picture(color, size).save(out, format="PNG")
    return out.getvalue()


WIDE, TALL = png((200, 30, 60), (84, 56)), png((10, 220, 90), (50, 90))
GRIDS = {WIDE: (2, 3), TALL: (3, 2)}  # (rows, columns) of placeholders, by transformers' smart_resize


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_qwen2_5_vl(VOCAB)
    folder = tmp_path_factory.mktemp("qwen2_5_vl-engine")
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model, str(folder)


def make_engine(folder: str, **limits) -> EngineCore:
    config = EngineConfig(model_id=folder, device="cpu", dtype="float32", max_batch_total_tokens=1024, **limits)
    return EngineCore.from_config(config)


def request(request_id: str, images: list[bytes]) -> tuple[GenerateRequest, list[int]]:
    ids, spans = [5, 6, 7], []
    for k, data in enumerate(images):
        rows, columns = GRIDS[data]
        ids += [START]
        digest = hashlib.sha256(data).hexdigest()
        spans.append(PromptImage(len(ids), rows * columns, digest, data, grid=(rows, columns)))
        ids += [IMAGE] * (rows * columns) + [END, 10 + k, 11 + k]
    return GenerateRequest(request_id, ids, max_new_tokens=NEW, ignore_eos=True, images=spans), ids


def token_ids(events) -> list[int]:
    return [t for event in events for t in event.token_ids]


def expected(model, ids: list[int], images: list[bytes]) -> list[int]:
    if not images:
        return reference_greedy(model, ids, None, NEW)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    return reference_greedy(model, ids, image_processor()(images=pictures, return_tensors="pt"), NEW)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_equal_transformers_with_two_images(checkpoint, prefill, overlap):
    model, folder = checkpoint
    engine = make_engine(folder, max_batch_prefill_tokens=prefill, overlap_scheduling=overlap)
    both, ids = request("both", [WIDE, TALL])
    text, text_ids = request("text", [])
    events = drain_events(engine, [both, text])
    assert token_ids(events["both"]) == expected(model, ids, [WIDE, TALL])
    assert token_ids(events["text"]) == expected(model, text_ids, [])


def test_the_same_image_is_encoded_once_and_hits_the_prefix_cache(checkpoint):
    model, folder = checkpoint
    engine = make_engine(folder)
    cache = engine.executor.batch_builder.images
    assert cache is not None
    first, ids = request("first", [WIDE])
    drain_events(engine, [first])
    again = drain_events(engine, [request("again", [WIDE])[0]])
    tall = drain_events(engine, [request("tall", [TALL])[0]])
    assert again["again"][0].num_cached_tokens == len(ids) - 1
    assert tall["tall"][0].num_cached_tokens == 4  # the text before the image only
    assert cache.num_encoded == 2
    assert token_ids(again["again"]) == expected(model, ids, [WIDE])
