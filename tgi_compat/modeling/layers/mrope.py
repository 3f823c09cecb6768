"""Qwen2.5-VL's multimodal rotary embedding (M-RoPE): the D/2 rotary frequencies are cut into three sections
(`mrope_section`, e.g. 16/24/24), rotated by a token's temporal, height and width position respectively.

A text token has the same position in all three, so its rotation is the plain rope of that position; an image
placeholder has (t, h, w) of its patch in the image's grid (tgi_compat.router.mrope). The step's positions are
then [3, T] instead of [T]; the mixed cos/sin rows are gathered once a step and the rotary ops (torch or Triton)
run on them unchanged, since they only read per-token rows of the tables.
"""

from __future__ import annotations

import torch

from tgi_compat.modeling.config import RopeScaling
from tgi_compat.modeling.layers.ops import LayerOps
from tgi_compat.modeling.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    section_of: torch.Tensor  # [D/2] int64: which of t/h/w rotates each frequency, a buffer

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling,
        max_positions: int,
        ops: LayerOps,
        mrope_section: list[int],
    ):
        super().__init__(head_dim, theta, scaling, max_positions, ops)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must add up to head_dim / 2 = {head_dim // 2}")
        sections = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("section_of", sections, persistent=False)

    def step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` [T] (every token text: plain rope) or [3, T] (t, h, w of each token)."""
        if positions.dim() == 1:
            return super().step_tables(positions)
        cos, sin = mrope_half_tables(self.cos_half, self.sin_half, positions, self.section_of)
        rows = torch.arange(positions.shape[1], device=positions.device)
        return self.ops.rope_tables(cos, sin, rows)


def mrope_half_tables(
    cos_half: torch.Tensor, sin_half: torch.Tensor, positions: torch.Tensor, section_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, D/2] tables and [3, T] positions -> [T, D/2] rows whose frequency j is read at positions[section_of[j]]
    (transformers' `recomposition_frequencies`, on the half tables)."""
    index = section_of.view(1, 1, -1).expand(1, positions.shape[1], -1)  # [1, T, D/2]
    cos = cos_half[positions].gather(0, index).squeeze(0)  # [3, T, D/2] -> [T, D/2]
    sin = sin_half[positions].gather(0, index).squeeze(0)
    return cos, sin
