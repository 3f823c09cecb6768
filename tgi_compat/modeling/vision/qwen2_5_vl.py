"""Qwen2.5-VL's vision encoder: transformers' own vision transformer (window attention, 2D rope, the 2x2 patch
merger) built from the checkpoint's config.json, so its outputs are transformers' by construction. It takes the
flattened patches and (t, h, w) grid of every image from transformers' Qwen2-VL image processor (dynamic
resolution: each image resized to a multiple of 28 pixels within min_pixels..max_pixels) and gives each image
(grid h / 2) * (grid w / 2) rows, one per `<|image_pad|>` placeholder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tgi_compat.modeling.layers.linear import default_weight_loader


@dataclass(frozen=True, slots=True)
class Qwen25VLImageTokens:
    """How an image appears in the prompt: `<|vision_start|>` + one `<|image_pad|>` per merged patch +
    `<|vision_end|>` (TGI's server-side text, vlm_causal_lm.image_text_replacement)."""

    image_token_id: int
    spatial_merge_size: int  # 2: a placeholder stands for merge x merge patches

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> Qwen25VLImageTokens:
        vision = d.get("vision_config") or {}
        return cls(d.get("image_token_id", 151655), vision.get("spatial_merge_size", 2))


@dataclass(frozen=True, slots=True)
class PlaceholderGrid:
    """An image's (rows, columns) of placeholders: transformers' own `smart_resize` (sides to multiples of
    patch * merge pixels, the area within the processor's min_pixels..max_pixels) over patch * merge."""

    factor: int  # patch_size * merge_size pixels per placeholder side
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_folder(cls, folder: str) -> PlaceholderGrid:
        """From the checkpoint's preprocessor_config.json (the processor the encoder runs)."""
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(folder)
        size = processor.size  # transformers moves a hub config's min_pixels/max_pixels here
        return cls(processor.patch_size * processor.merge_size, size.shortest_edge, size.longest_edge)

    def __call__(self, height: int, width: int) -> tuple[int, int]:
        # the Pillow processor module: the same function, with no torchvision import
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        resized_height, resized_width = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return resized_height // self.factor, resized_width // self.factor


def _vision_config(hf_config: dict[str, Any]) -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(**{key: value for key, value in hf_config.items() if key != "model_type"}).vision_config


class Qwen25VLVisionEncoder(nn.Module):
    """(pixel_values [patches, C * t * p * p], image_grid_thw [N, 3]) -> each image's [(h / 2) * (w / 2), hidden]."""

    def __init__(self, hf_config: dict[str, Any]):
        super().__init__()
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        dtype = torch.get_default_dtype()  # the runner builds the model under the serving dtype
        self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(_vision_config(hf_config), dtype=dtype)
        self.merge = self.visual.spatial_merge_size
        for param in self.parameters():  # loaded by models/weight_names.load_packed_weights, as ours are
            param.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    @torch.inference_mode()
    def forward(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        grid = processed["image_grid_thw"]
        pixels = processed["pixel_values"].to(self.visual.patch_embed.proj.weight.dtype)
        rows = self.visual(pixels, grid_thw=grid).pooler_output
        return list(torch.split(rows, (grid.prod(-1) // self.merge**2).tolist()))
