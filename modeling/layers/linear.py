"""Linear layers, including the fused ones that turn 3 (q, k, v) or 2 (gate, up) matmuls into one.

Parameters are allocated uninitialised (weights always come from a checkpoint) and carry a
`weight_loader(param, tensor, shard)` that knows where a checkpoint tensor lands in them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.gemv import PROLOGUE_NONE, GemvConfig, gemv, gemv_config

# On CPU, oneDNN's matmul runs the few-row products of decoding 1.3-2x faster than F.linear's MKL
# GEMV (2-core AVX2 VM, float32: LM head 49152x576 at 1 row 6.2 vs 9.7 ms, gate|up 3072x576 0.37 vs
# 0.66 ms), and loses a little on prefill-sized inputs; so only rows <= this take it.
_ONEDNN_MAX_ROWS = 16
_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: F.linear; oneDNN for few-row float32 inputs on CPU; kernels.gemv for one
    half-precision row on CUDA (batch-1 decode), where it reads the weight faster than cuBLAS."""
    if x.is_cuda:
        config = one_row_gemv_config(x, weight, PROLOGUE_NONE)
        if config is not None:
            return gemv(x, weight, bias, config=config)
    elif _onednn_linear is not None and x.dtype == torch.float32 and x.shape[0] <= _ONEDNN_MAX_ROWS:
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def one_row_gemv_config(x: torch.Tensor, weight: torch.Tensor, prologue: int) -> GemvConfig | None:
    """kernels.gemv's config when x is one fp16/bf16 row on CUDA and the shape is worth fusing, else None."""
    if x.shape[0] != 1 or x.dtype not in (torch.float16, torch.bfloat16) or not x.is_cuda:
        return None
    return gemv_config(weight.shape[0], weight.shape[1], prologue)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


WeightLoader = Callable[[nn.Parameter, torch.Tensor, object], None]  # (param, checkpoint tensor, shard)


class LoadableParameter(nn.Parameter):
    """A parameter that carries the loader placing a checkpoint tensor in it."""

    weight_loader: WeightLoader


def new_param(*shape: int, loader: WeightLoader = default_weight_loader) -> LoadableParameter:
    param = LoadableParameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_param(out_features, in_features, loader=self.load_shard)
        self.bias = new_param(out_features, loader=self.load_shard) if bias else None

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; shard = their index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.out_sizes = out_sizes

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        index = self.shard_index(shard)
        start, size = self.offsets[index], self.out_sizes[index]
        default_weight_loader(param.data.narrow(0, start, size), loaded)

    def shard_index(self, shard: object) -> int:
        if not isinstance(shard, int):
            raise TypeError(f"{type(self).__name__} shards are numbered, got {shard!r}")
        return shard


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: output [T, (H + 2 * H_kv) * D]; shard = "q" | "k" | "v"."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def shard_index(self, shard: object) -> int:
        return ("q", "k", "v").index(shard)
