"""Idefics3's image text (served by the transformers fallback, models/transformers_vlm.py), as TGI's
vlm_causal_lm.image_text_replacement writes it: for each tile of the image processor's split, row by row,
`<fake_token_around_image><row_R_col_C>` + N `<image>`, a newline after each row of tiles, then
`\\n<fake_token_around_image><global-img>` + N `<image>` + `<fake_token_around_image>` for the whole image, where N is
the vision tower's patches per tile over scale_factor². Only the `<image>`s take encoder rows (tiles in order, the
global image last); the tokens between them keep their own embeddings (PromptImage.embeds)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_FAKE, _IMAGE, _GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"


@dataclass(frozen=True, slots=True)
class Idefics3ImageTokens:
    image_token_id: int
    tile_tokens: int  # `<image>`s per tile
    longest_edge: int | None  # the processor's resize of the longest edge (None: do_resize off)
    tile: int | None  # its split tiles' side in pixels (max_image_size); None: do_image_splitting off

    @classmethod
    def from_checkpoint(cls, d: dict[str, Any], folder: str) -> Idefics3ImageTokens:
        """From config.json `d` and the checkpoint's preprocessor_config.json (the processor the encoder runs)."""
        from transformers import Idefics3Config

        from tgi_compat.modeling.vision.processors import image_processor

        c = Idefics3Config(**{key: value for key, value in d.items() if key != "model_type"})
        vision: Any = c.vision_config
        processor = image_processor(folder)
        tile_tokens = int((vision.image_size // vision.patch_size) ** 2 / c.scale_factor**2)
        longest = processor.size["longest_edge"] if processor.do_resize else None
        tile = processor.max_image_size["longest_edge"] if processor.do_image_splitting else None
        return cls(c.image_token_id, tile_tokens, longest, tile)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of the processor's tiles for an image of that size; (0, 0) when it is not split (its
        Idefics3ImageProcessor._preprocess sizes, transcribed: resize, round up to whole tiles, split)."""
        if self.tile is None:
            return 0, 0
        if self.longest_edge is not None:
            from transformers.models.idefics3.image_processing_pil_idefics3 import (
                MAX_IMAGE_SIZE,
                _resize_output_size_rescale_to_max_len,
                _resize_output_size_scale_below_upper_bound,
            )

            height, width = _resize_output_size_rescale_to_max_len(height, width, max_len=self.longest_edge)
            # transformers annotates max_len as a dict but passes (and reads) an int
            height, width = _resize_output_size_scale_below_upper_bound(height, width, max_len=MAX_IMAGE_SIZE)  # type: ignore[arg-type]
        aspect, tile = width / height, self.tile
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        if height > tile or width > tile:
            return math.ceil(height / tile), math.ceil(width / tile)
        return 0, 0

    def text(self, height: int, width: int) -> str:
        """TGI's image text (its _prompt_split_image, also for an image that is not split: rows = cols = 0)."""
        rows, columns = self.grid(height, width)
        run = _IMAGE * self.tile_tokens
        tiles = "".join(
            "".join(f"{_FAKE}<row_{r + 1}_col_{c + 1}>{run}" for c in range(columns)) + "\n" for r in range(rows)
        )
        return f"{tiles}\n{_FAKE}{_GLOBAL}{run}{_FAKE}"

    def count(self, height: int, width: int) -> int:
        """Its `<image>`s: the encoder rows of its tiles and global image."""
        rows, columns = self.grid(height, width)
        return (rows * columns + 1) * self.tile_tokens
