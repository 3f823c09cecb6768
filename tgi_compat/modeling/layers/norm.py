"""RMSNorm whose forward optionally adds the residual first (one fused op on GPU)."""

from __future__ import annotations

import torch
import torch.nn as nn

from tgi_compat.modeling.layers.linear import new_param
from tgi_compat.modeling.layers.ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = new_param(dim)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (norm(x + residual), x + residual); with no residual, (norm(x), None)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
