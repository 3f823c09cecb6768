"""Mllama's (Llama 3.2 Vision) images, served by the transformers fallback (models/mllama.py): one `<|image|>` token
per image in the prompt, as TGI writes it; the text after it cross-attends to the image's vision states instead of
reading placeholder rows. The processor splits an image into up to `max_image_tiles` tiles (padded with blank
ones); the text attends to its real tiles only, so the engine needs their count (`tiles`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class MllamaImageTokens:
    image_token_id: int
    tile_size: int  # the processor's tile side in pixels
    max_tiles: int

    @classmethod
    def from_checkpoint(cls, d: dict[str, Any], folder: str) -> MllamaImageTokens:
        """From config.json `d` and the checkpoint's preprocessor_config.json."""
        from tgi_compat.modeling.vision.processors import image_processor

        processor = image_processor(folder)
        return cls(int(d["image_token_index"]), int(processor.size["height"]), int(processor.max_image_tiles))

    def tiles(self, height: int, width: int) -> int:
        """The real tiles of an image of that size: the canvas MllamaImageProcessor resizes it onto."""
        from transformers.models.mllama.image_processing_pil_mllama import get_optimal_tiled_canvas

        canvas_height, canvas_width = get_optimal_tiled_canvas(height, width, self.max_tiles, self.tile_size)
        return int(canvas_height // self.tile_size) * int(canvas_width // self.tile_size)
