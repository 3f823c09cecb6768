"""Image files -> each image's placeholder rows: the checkpoint's own image processor (transformers',
from its preprocessor_config.json), then the model's vision encoder. The engine calls it once per image it
has not cached (tgi_compat.router.image_cache)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Protocol

import torch
from PIL import Image


class VisionLanguageModel(Protocol):
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, placeholder tokens per image, hidden]."""
        ...


class ImageEncoder:
    def __init__(self, model: VisionLanguageModel, folder: str, device: torch.device):
        from transformers import AutoImageProcessor

        self.model = model
        self.processor = AutoImageProcessor.from_pretrained(folder)
        self.device = device

    @torch.inference_mode()
    def __call__(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        pixel_values = self.processor(images=pictures, return_tensors="pt")["pixel_values"]
        return list(self.model.encode_images(pixel_values.to(self.device)))
