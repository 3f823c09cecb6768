"""A prompt's images in the engine: where each one's placeholder tokens sit, its bytes and its content hash.

The API puts an image's placeholder run into `prompt_ids` (Gemma 3: N `<image_soft_token>`s) and the image here.
Every image's placeholders carry the same ids, so the prefix cache keys them by the image instead
(`image_keyed_ids`): a repeated image (a multi-turn chat about one picture) finds its KV again, and two different
images never share any.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

# An image key lies below -2**84 and steps by 2**64, so that a LoRA tag (< 2**64, added to every key by
# Request.cache_ids) keeps it negative and apart from every other image's and every token id's.
_KEY_STEP_BITS = 64
_HASH_BITS = 60


@dataclass(frozen=True, slots=True)
class PromptImage:
    offset: int  # position of its first placeholder token in prompt_ids
    length: int  # its placeholder tokens
    digest: str  # sha256 of the image file as the client sent it, hex
    data: bytes  # that file; or, where `resized` is set, the image as the API resized it for the encoder
    bidirectional: bool = False  # its placeholders attend to each other both ways during prefill (Gemma 3)
    # (rows, columns) of its placeholders over the merged patch grid: an M-RoPE model's (Qwen2.5-VL,
    # tgi_compat.router.mrope); None: the image rotates as text does
    grid: tuple[int, int] | None = None
    # the positions in [offset, end), relative to offset and ascending, that take its rows, where its text
    # interleaves them with tokens that keep their own embeddings (Idefics3's row/column tokens); None: all of them
    embeds: tuple[int, ...] | None = None
    # what the prefix cache keys its span by, where the span's K/V depends on more than the image (PaliGemma's
    # span is its whole prompt, which attends both ways: the hash of all of it); None: its digest
    key: str | None = None
    # its real tiles, whose keys the text after it attends to: a cross-attending model's (Mllama,
    # tgi_compat.router.cross_attention); None for any other
    tiles: int | None = None
    # (height, width): `data` holds the image's RGB rows (uint8) at the sides the encoder takes, resized in the API's
    # process (Qwen-VL's, tgi_compat/modeling/vision/qwen_vl_pixels.py); None: `data` is the file
    resized: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def rows_at(self, first: int, last: int) -> tuple[slice, list[int]]:
        """Its placeholders among prompt positions [first, last) (inside [offset, end)): the slice of its rows
        they take and their positions."""
        if self.embeds is None:
            return slice(first - self.offset, last - self.offset), list(range(first, last))
        lo, hi = bisect_left(self.embeds, first - self.offset), bisect_left(self.embeds, last - self.offset)
        return slice(lo, hi), [self.offset + p for p in self.embeds[lo:hi]]


def image_keyed_ids(ids: list[int], images: Sequence[PromptImage]) -> list[int]:
    """`ids` (positions [0, len(ids)) of a prompt) with each image placeholder replaced by a key made of the
    image's hash and the placeholder's index in the image."""
    keyed = list(ids)
    for image in images:
        if image.offset >= len(ids):
            break
        base = (int((image.key or image.digest)[: _HASH_BITS // 4], 16) << 20) + 1
        for position in range(image.offset, min(image.end, len(ids))):
            keyed[position] = -((base + position - image.offset) << _KEY_STEP_BITS)
    return keyed


def whole_images(start: int, num_new: int, images: Sequence[PromptImage]) -> int:
    """A prefill chunk of positions [start, start + num_new) cut so that it splits no bidirectional image: it
    stops before the image it would split, or, when it starts at (or inside) one, runs to the image's end even
    past its budget (the image's placeholders must see each other in one step)."""
    end = start + num_new
    for image in images:
        if image.bidirectional and image.offset < end < image.end:
            return image.offset - start if image.offset > start else image.end - start
    return num_new
