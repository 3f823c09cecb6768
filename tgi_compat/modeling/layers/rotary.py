"""Rotary position embedding: a cos/sin cache over all positions, with llama3/linear/dynamic/longrope scaling.

The cache is built once in float32 (as transformers does) and stored in the model dtype; each step
gathers its positions once (`step_tables`) and every layer reuses them.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tgi_compat.modeling.config import RopeScaling
from tgi_compat.modeling.layers.ops import LayerOps


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)  # [D/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling, max_positions: int) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_context = scaling.original_max_position_embeddings or max_positions
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    return torch.outer(positions.float(), inv_freq)  # [P, D/2]


def build_cos_sin(
    head_dim: int, theta: float, scaling: RopeScaling, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns cos, sin [P, D/2] in float32 for positions 0..P-1 (P grows for dynamic scaling)."""
    inv_freq = _base_inv_freq(head_dim, theta)
    positions = torch.arange(max_positions)
    if scaling.rope_type == "longrope":
        return _longrope_cos_sin(inv_freq, scaling, max_positions)
    if scaling.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling, max_positions)
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    if scaling.rope_type != "dynamic":
        angles = _angles(positions, inv_freq)
        return angles.cos(), angles.sin()
    # Dynamic NTK: positions inside the trained context keep the plain frequencies (as transformers
    # does for short sequences); positions past it use the base stretched for max_positions * factor,
    # fixed rather than per sequence length so that cached keys never need re-rotating.
    long_len = int(max_positions * scaling.factor)
    base = theta * (scaling.factor * long_len / max_positions - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
    short = _angles(positions, inv_freq)
    long = _angles(torch.arange(max_positions, long_len), _base_inv_freq(head_dim, base))
    angles = torch.cat((short, long))
    return angles.cos(), angles.sin()


def _longrope_cos_sin(
    inv_freq: torch.Tensor, scaling: RopeScaling, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE (Phi-3): frequencies divided by short_factor inside the original context and by
    long_factor past it, cos/sin scaled by the attention factor. transformers switches every position
    to the long factors once a sequence passes the original context; we switch per position, so
    cached keys never need re-rotating (vLLM does the same): identical up to that length."""
    original = scaling.original_max_position_embeddings
    assert original is not None, "longrope scaling names its original context"
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = 1.0
        if scaling.factor > 1.0:
            attention_factor = math.sqrt(1 + math.log(scaling.factor) / math.log(original))
    short = _angles(torch.arange(min(original, max_positions)), inv_freq / torch.tensor(scaling.short_factor))
    long = _angles(torch.arange(original, max_positions), inv_freq / torch.tensor(scaling.long_factor))
    angles = torch.cat((short, long))
    return angles.cos() * attention_factor, angles.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    cos_half: torch.Tensor  # [P, D/2], a buffer
    sin_half: torch.Tensor  # [P, D/2], a buffer

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, max_positions: int, ops: LayerOps):
        super().__init__()
        self.ops = ops
        cos, sin = build_cos_sin(head_dim, theta, scaling, max_positions)
        dtype = torch.get_default_dtype()
        self.register_buffer("cos_half", cos.to(dtype), persistent=False)  # [P, D/2]
        self.register_buffer("sin_half", sin.to(dtype), persistent=False)  # [P, D/2]

    def step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rope_tables(self.cos_half, self.sin_half, positions)
