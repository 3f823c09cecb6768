"""Image files -> each image's placeholder rows: the checkpoint's own image processor (transformers',
from its preprocessor_config.json), then the model's vision encoder. The engine calls it once per image it
has not cached (tgi_compat.router.image_cache)."""

from __future__ import annotations

import functools
import io
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from PIL import Image


class VisionLanguageModel(Protocol):
    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's tensors (pixel_values, and Qwen2.5-VL's image_grid_thw) -> each image's
        placeholder rows [tokens, hidden]."""
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
        processed = self.processor(images=pictures, return_tensors="pt")
        return self.model.encode_processed({name: value.to(self.device) for name, value in processed.items()})
