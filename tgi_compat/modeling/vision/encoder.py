"""Image files -> each image's placeholder rows: the checkpoint's own image processor (transformers',
from its preprocessor_config.json), then the model's vision encoder. The engine calls it once per image it
has not cached (tgi_compat.router.image_cache)."""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from PIL import Image


class VisionLanguageModel(Protocol):
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, placeholder tokens per image, hidden]."""
        ...


class ImageEncoder:
    def __init__(self, model: VisionLanguageModel, folder: str, device: torch.device):
        self.model = model
        self.folder = folder
        self.device = device

    @functools.cached_property
    def processor(self) -> Any:
        """Loaded with the first image: a checkpoint served text-only needs no preprocessor_config.json."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.folder)

    @torch.inference_mode()
    def __call__(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        pixel_values = self.processor(images=pictures, return_tensors="pt")["pixel_values"]
        return list(self.model.encode_images(pixel_values.to(self.device)))
