"""M-RoPE positions of a Qwen2.5-VL request (transformers' `get_rope_index`, one request at a time).

Text tokens count up one by one in all three of (t, h, w); an image's placeholders, laid out row by row over its
merged grid (gh x gw), take (p, p + row, p + column) where p is the position after the text before it, and the
text after the image continues at p + max(gh, gw). Past the prompt every token rotates by its sequence position
plus the prompt's `delta` (the last M-RoPE position + 1 - prompt length), which the engine keeps per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tgi_compat.router.images import PromptImage


@dataclass(frozen=True, slots=True)
class MropePrompt:
    positions: tuple[list[int], list[int], list[int]]  # (t, h, w) of each prompt position
    delta: int  # added to a generated token's sequence position

    def rows(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """(t, h, w) of sequence positions [start, end): the prompt's, then position + delta."""
        prompt_len = len(self.positions[0])
        after = list(range(max(start, prompt_len) + self.delta, end + self.delta))
        t, h, w = (axis[start:end] + after for axis in self.positions)
        return t, h, w


def prompt_mrope(prompt_len: int, images: Sequence[PromptImage]) -> MropePrompt | None:
    """The request's M-RoPE positions; None where it has no gridded image (its positions are the plain ones)."""
    gridded = [image for image in images if image.grid is not None]
    if not gridded:
        return None
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    cursor, next_position = 0, 0  # sequence position reached, and the M-RoPE position it has
    for image in gridded:
        assert image.grid is not None
        rows, columns = image.grid
        if rows * columns != image.length:
            raise ValueError(f"an image of {image.length} placeholders cannot have a {rows}x{columns} grid")
        text = range(next_position, next_position + image.offset - cursor)
        t += text
        h += text
        w += text
        start = next_position + image.offset - cursor
        t += [start] * image.length
        h += [start + r for r in range(rows) for _ in range(columns)]
        w += [start + c for _ in range(rows) for c in range(columns)]
        cursor, next_position = image.end, start + max(rows, columns)
    text = range(next_position, next_position + prompt_len - cursor)
    t += text
    h += text
    w += text
    return MropePrompt((t, h, w), next_position + prompt_len - cursor - prompt_len)
