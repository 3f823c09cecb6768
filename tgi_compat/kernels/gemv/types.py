"""What a GEMV launch is made of: the fused prologue, the weight's format and the launch config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tgi_compat.kernels.quant.int4_layout import int4_period, unpack_int4

# The op fused in front of the product (the kernels' PROLOGUE constexpr; see tgi_compat/kernels/gemv/gemv.py)
PROLOGUE_NONE = 0
PROLOGUE_RMSNORM = 1
PROLOGUE_SILU_MUL = 2
PROLOGUE_GELU_TANH_MUL = 3
PROLOGUE_NORM_ADD_NORM = 4

# How the weight is stored
WEIGHT_DENSE = 0
WEIGHT_ROW_SCALED = 1
WEIGHT_INT4 = 2


class Activations(NamedTuple):
    """x and the prologue's tensors: every GEMV kernel's first four arguments (an unused one: any tensor)."""

    x: torch.Tensor  # [M, K], or [M, 2K] for the gated prologues; rows of stride x.stride(0)
    residual: torch.Tensor  # [M, K] contiguous, added to x before the norm
    residual_out: torch.Tensor  # [M, K] contiguous, receives x + residual (never aliases residual)
    norm_weight: torch.Tensor  # [K]: the RMSNorm's


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight the GEMV dequantizes in registers, in the layout the quantized linear methods keep."""

    data: (
        torch.Tensor
    )  # int8 / float8_e4m3fn [N, K], or int32 [N, K/8] for int4 (tgi_compat.kernels.quant.int4_layout's layout)
    scale: torch.Tensor  # [N] per output channel, a single value per tensor, or [N, K/G] for int4
    zero: torch.Tensor | None = None  # int4: [N, K/G] integer zero points, same strides as scale
    group_size: int = 0  # int4: G

    @property
    def format(self) -> int:
        return WEIGHT_INT4 if self.zero is not None else WEIGHT_ROW_SCALED

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [N, K]."""
        n, cols = self.data.shape
        return n, cols * 8 if self.format == WEIGHT_INT4 else cols

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        if self.format == WEIGHT_ROW_SCALED:
            return self.data.float() * self.scale.float().reshape(-1, 1)
        assert self.zero is not None
        q = unpack_int4(self.data, int4_period(self.group_size)).float()
        zero = self.zero.float().repeat_interleave(self.group_size, 1)
        return (q - zero) * self.scale.float().repeat_interleave(self.group_size, 1)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    # issue the next weight tile's loads before this tile's arithmetic (registers: 2 tiles; the dense and the int4
    # tile kernels)
    prefetch: bool = False
    # int4: programs sharing each column's K walk (any count; halved while it does not divide K into whole
    # periods); the last to finish adds the partial sums. More programs in flight where N / block_n is small
    # against the SMs.
    split_k: int = 1
    # run the prologue (RMSNorm, SiLU/GeLU-mul) as its own kernel (tgi_compat/kernels/elementwise/) and the GEMV
    # without one: one more launch, but each activation computed once instead of once a program (the int4 kernel's
    # few weight rows a program make the fused prologue a large share of its instructions)
    separate_prologue: bool = False
    # int4 at one row: tgi_compat/kernels/gemv/int4_one_row.py's kernel (block_n rows a program, K tiles of block_k
    # features) instead of the tile kernel
    one_row: bool = False
