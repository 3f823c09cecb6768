"""Qwen-VL's host half in the API's process (tgi_compat/api/serving/images.py, vision/qwen_vl_pixels.py): the image is
resized where it is decoded, the engine's image is its resized RGB rows, and the engine's encoder takes them with no
decode to the processor's own pixel values. /tokenize's expansion resizes nothing."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.modeling.qwen2_5_vl_helpers import IMAGE_TOKENS, image_processor, tiny_qwen2_5_vl
from tests.modeling.vision_server import write_checkpoint
from tgi_compat.api.protocol.images import image_markdown
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import VisionPrompts
from tgi_compat.modeling.source import resolve_model_source
from tgi_compat.modeling.vision.encoder import ImageEncoder
from tgi_compat.modeling.vision.qwen_vl_pixels import RESIZED
from tgi_compat.modeling.weights.loader import load_model_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl-resize")
    write_checkpoint(folder, IMAGE_TOKENS, IMAGE_TOKENS[3], tiny_qwen2_5_vl, image_processor())
    return str(folder)


def noise_png(height: int, width: int) -> tuple[Image.Image, str]:
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return image, image_markdown(f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}")


async def test_the_api_sends_the_resized_pixels_the_processor_would_make(folder):
    vision = VisionPrompts.of(load_model_config(resolve_model_source(folder)), ImageFetcher(), folder)
    assert vision is not None and vision.resize is not None
    image, markdown = noise_png(75, 131)  # resized up past min_pixels, to sides not its own
    _, loaded = await vision.expand(f"look: {markdown}")
    length = vision.placeholders(loaded[0]).length
    (placed,) = vision.place([5, *[vision.image_token_id] * length, 6], loaded)
    assert placed.resized is not None and placed.data != loaded[0].data
    # the processor's own grid, and the engine's pixels are its own values: no decode in the engine's process
    processor = image_processor()
    theirs = processor(images=[image], return_tensors="pt")
    height, width = placed.resized
    assert (height // processor.patch_size, width // processor.patch_size) == tuple(theirs["image_grid_thw"][0, 1:])
    encoder = ImageEncoder(model=None, folder=folder, device=torch.device("cpu"))  # type: ignore[arg-type]
    ours = encoder.batch([encoder.preprocess_async(placed.data, placed.resized).result()])
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    torch.testing.assert_close(ours["pixel_values"], theirs["pixel_values"], rtol=0, atol=1e-6)
    # the same file sent as a file: the engine decodes and resizes it to the same pixels
    from_file, from_api = encoder.preprocess(loaded[0].data), encoder.preprocess(placed.data, placed.resized)
    assert torch.equal(from_file[RESIZED], from_api[RESIZED])


async def test_tokenizing_expands_the_text_without_resizing(folder):
    vision = VisionPrompts.of(load_model_config(resolve_model_source(folder)), ImageFetcher(), folder)
    assert vision is not None
    _, markdown = noise_png(75, 131)
    text, loaded = await vision.expand(markdown, for_engine=False)
    assert loaded[0].resized is None and text == (await vision.expand(markdown))[0]
