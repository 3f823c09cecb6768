"""A Qwen-VL image processor's work split between host and device (tgi_compat/modeling/vision/qwen_vl_pixels.py):
Pillow's resize on the host, then the patch flattening and normalisation, must give transformers' processor's own
output on noise images. Noise makes every resize filter tap count. The images are scaled up, scaled down past
max_pixels, odd-sided and narrow. A processor whose output the split does not reproduce keeps the host path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tgi_compat.modeling.vision.qwen_vl_pixels import RESIZED, DeviceNormalize, DevicePatchify

SIZES = [(1024, 1024), (75, 131), (333, 97), (2000, 60), (29, 29)]  # (height, width)


def noise(height: int, width: int, seed: int = 1) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processor():
    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)


@pytest.mark.parametrize("size", SIZES)
def test_resized_then_flattened_on_the_device_equals_the_processor(processor, size):
    patchify = DevicePatchify.of(processor)
    assert patchify is not None
    image = noise(*size)
    theirs = processor(images=[image], return_tensors="pt", do_rescale=False, do_normalize=False)
    ours = patchify.resize(image)
    assert ours[RESIZED].dtype == torch.uint8  # the bytes sent: the resized image, one frame
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert torch.equal(patchify(ours[RESIZED]).float(), theirs["pixel_values"])
    # and normalised there: the processor's float32 values to their rounding
    normalize = DeviceNormalize.of(processor, torch.device("cpu"))
    assert normalize is not None
    expected = processor(images=[image], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(normalize(patchify(ours[RESIZED])), expected, rtol=0, atol=1e-6)


def _inverted_call(self, images, **kwargs):
    return Qwen2VLImageProcessorPil.__call__(self, [ImageOps.invert(image) for image in images], **kwargs)


# the family's own class name, but its pixels are not Pillow's resize of the image: `of` probes, it does not trust names
Inverted = type("Qwen2VLImageProcessorPil", (Qwen2VLImageProcessorPil,), {"__call__": _inverted_call})


def test_a_processor_the_split_does_not_reproduce_keeps_the_host_path():
    assert DevicePatchify.of(Inverted(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)) is None
