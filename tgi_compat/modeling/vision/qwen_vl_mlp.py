"""Qwen2.5-VL's vision MLP as the encoder runs it (modeling/vision/qwen2_5_vl.py): transformers' SwiGLU module, its
inner width padded to a multiple of 64 and its gate and up weights one tensor, loading the checkpoint's own shapes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from tgi_compat.modeling.weights.lazy import LazyTensor, take

if TYPE_CHECKING:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

MLP_ALIGN = 64  # the vision MLP's inner width, rounded up to a multiple of this (PaddedSwiGLU)


class PaddedSwiGLU(nn.Module):
    """Qwen2.5-VL's SwiGLU vision MLP (transformers' Qwen2_5_VLMLP: the same parameter names and forward), its inner
    width padded with zeros to a multiple of `align` and its gate and up weights two halves of one [gate | up]
    tensor, so that `fused` runs one GEMM and one SiLU-and-mul pass where the forward runs two GEMMs and three
    passes.

    The 7B's width of 3420 makes rows of 6,840 bytes, which cuBLAS's fast bf16 kernels do not take: its three GEMMs
    ran at ~230 TFLOP/s on an H100 against ~650 for the blocks' other GEMMs, 19 of the encoder's 30 ms per image
    (docs/benchmarks/2026-12-05-session-24.md). Padded, gate and up give 0 there, silu(0) * 0 = 0, and down's zero
    columns add nothing: the same sums. The checkpoint's tensors load into each parameter's unpadded corner. Built
    on its device and never moved: gate_proj's and up_proj's parameters are views of `gate_up_weight`."""

    def __init__(self, mlp: Qwen2_5_VLMLP, align: int = MLP_ALIGN):
        super().__init__()
        gate: nn.Linear = mlp.gate_proj
        up: nn.Linear = mlp.up_proj
        down: nn.Linear = mlp.down_proj
        hidden, inner = gate.in_features, gate.out_features
        padded = -(-inner // align) * align
        weight, bias = gate.weight, gate.bias
        self.gate_up_weight = torch.zeros(2 * padded, hidden, device=weight.device, dtype=weight.dtype)
        self.gate_up_bias = None if bias is None else weight.new_zeros(2 * padded)
        self.gate_proj = _linear_on(self.gate_up_weight, self.gate_up_bias, slice(0, padded), gate)
        self.up_proj = _linear_on(self.gate_up_weight, self.gate_up_bias, slice(padded, 2 * padded), up)
        self.down_proj = _padded_linear(down, down.out_features, padded)
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' forward."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def fused(self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One [gate | up] GEMM, `silu_mul` of its [T, 2I] output, the down GEMM."""
        assert self.gate_proj.weight.data_ptr() == self.gate_up_weight.data_ptr(), "moved after it was built"
        return self.down_proj(silu_mul(nn.functional.linear(x, self.gate_up_weight, self.gate_up_bias)))


def swiglu_mlp(mlp: nn.Module) -> nn.Module:
    """A Qwen2.5-VL block's MLP as PaddedSwiGLU; Qwen2-VL's GELU MLP (4 x the width: aligned) as it is."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    return PaddedSwiGLU(mlp) if isinstance(mlp, Qwen2_5_VLMLP) else mlp


def _linear_on(weight: torch.Tensor, bias: torch.Tensor | None, rows: slice, linear: nn.Linear) -> nn.Linear:
    """An nn.Linear whose parameters are `rows` of `weight` and `bias` (zero views), `linear`'s in their corner."""
    view = nn.Linear(weight.shape[1], rows.stop - rows.start, bias is not None, "meta")  # parameters replaced below
    view.weight = nn.Parameter(weight[rows], requires_grad=False)
    if bias is not None:
        view.bias = nn.Parameter(bias[rows], requires_grad=False)
    _take_corners(view, linear)
    return view


def _padded_linear(linear: nn.Linear, out_features: int, in_features: int) -> nn.Linear:
    """A zero nn.Linear of the larger shape, `linear`'s weights in its corner."""
    weight = linear.weight
    padded = nn.Linear(in_features, out_features, linear.bias is not None, weight.device, weight.dtype)
    with torch.no_grad():
        padded.weight.zero_()
        if padded.bias is not None:
            padded.bias.zero_()
    _take_corners(padded, linear)
    return padded


def _take_corners(padded: nn.Linear, linear: nn.Linear) -> None:
    """`linear`'s parameters so far (transformers' initialisation) into the corners of `padded`'s, whose loaders
    then take the checkpoint's tensors of `linear`'s shapes there."""
    with torch.no_grad():
        for new, old in ((padded.weight, linear.weight), (padded.bias, linear.bias)):
            if new is not None and old is not None:
                _copy_into_corner(new, old)
                new.weight_loader = functools.partial(_load_into_corner, shape=old.shape)  # type: ignore[attr-defined]


def _copy_into_corner(param: torch.Tensor, tensor: torch.Tensor) -> None:
    param.data[tuple(slice(0, size) for size in tensor.shape)].copy_(tensor)


def _load_into_corner(
    param: torch.Tensor, loaded: torch.Tensor | LazyTensor, shard: object = None, *, shape: torch.Size
) -> None:
    """A checkpoint tensor of the unpadded `shape` into the leading corner of its padded parameter (the rest stays
    zero)."""
    loaded = take(loaded)
    if loaded.shape != shape:
        raise ValueError(f"shape mismatch: parameter {tuple(shape)} vs checkpoint {tuple(loaded.shape)}")
    _copy_into_corner(param, loaded)
