"""LayerOps backed by the Triton kernels in kernels/ (selected by `select_ops` on CUDA).

Same contract as TORCH_OPS in ops.py. Rotary rotates in place and returns its input (the
[T, H + H_kv, D] q|k view of the fused qkv output, so q and k turn in one launch).
"""

from __future__ import annotations

import torch

from kernels.rmsnorm import rmsnorm
from kernels.rotary import rotary_embedding
from kernels.silu_mul import silu_mul
from modeling.layers.ops import LayerOps


def triton_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is None:
        return rmsnorm(x, weight, eps), None
    summed = torch.empty_like(residual)  # a fresh tensor: the caller's residual may still be referenced
    return rmsnorm(x, weight, eps, residual=residual, residual_out=summed), summed


def triton_rope_tables(
    cos_half: torch.Tensor, sin_half: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # [T, D/2] each: gathered once per step, read by every layer's rotary launch
    return cos_half[positions], sin_half[positions]


def triton_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = tables
    rotary_embedding(x, None, cos, sin)
    return x


TRITON_OPS = LayerOps(
    name="triton",
    rms_norm=triton_rms_norm,
    rope_tables=triton_rope_tables,
    rotary=triton_rotary,
    silu_and_mul=silu_mul,
)
