"""SwiGLU's activation on the fused gate_up output."""

from __future__ import annotations

import torch
import torch.nn as nn

from modeling.layers.ops import LayerOps


class SiluAndMul(nn.Module):
    def __init__(self, ops: LayerOps):
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        # [T, 2 * I] -> [T, I]
        return self.ops.silu_and_mul(gate_up)
