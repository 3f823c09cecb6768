"""LLaVA-Next's image placeholders (served by the transformers fallback, models/transformers_vlm.py): one `<image>`
per feature row that transformers' model packs for the image (anyres: a base tile, then the best grid of tiles
with the padding cut away and one newline row per row of patches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LlavaNextImageTokens:
    image_token_id: int
    grid_pinpoints: list[list[int]]  # the tile grids' (height, width) in pixels
    tile_size: int  # the vision tower's image_size: pixels per tile side
    patch_size: int
    cls_row: bool  # vision_feature_select_strategy "full" keeps the tower's CLS row

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> LlavaNextImageTokens:
        from transformers import LlavaNextConfig

        c = LlavaNextConfig(**{key: value for key, value in d.items() if key != "model_type"})
        vision: Any = c.vision_config  # a config object once LlavaNextConfig has read it
        strategy = c.vision_feature_select_strategy
        assert c.image_grid_pinpoints is not None  # LlavaNextConfig fills in its default grids
        return cls(c.image_token_id, c.image_grid_pinpoints, vision.image_size, vision.patch_size, strategy == "full")

    def count(self, height: int, width: int) -> int:
        """An image's placeholders: transformers' LlavaNextProcessor count (the rows its model packs). TGI counts
        the tile grid transposed (its LLaVA-NeXT issue 59 swap), the same count whenever the best grid is square."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution((height, width), self.grid_pinpoints)
        side = self.tile_size // self.patch_size  # patches per tile side
        rows, columns = side * (best_height // self.tile_size), side * (best_width // self.tile_size)
        if width / height > columns / rows:  # letterboxed: padding rows above and below are cut
            rows -= 2 * ((rows - int(round(height * (columns / width), 7))) // 2)
        else:
            columns -= 2 * ((columns - int(round(width * (rows / height), 7))) // 2)
        return rows * columns + rows + side * side + int(self.cls_row)
