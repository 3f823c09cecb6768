"""Linear layers, including the fused ones that turn 3 (q, k, v) or 2 (gate, up) matmuls into one.

Parameters are allocated uninitialised (weights always come from a checkpoint) and carry a
`weight_loader(param, tensor, shard)` that knows where a checkpoint tensor lands in them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _new_param(*shape: int, loader=default_weight_loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _new_param(out_features, in_features, loader=self.load_shard)
        self.bias = _new_param(out_features, loader=self.load_shard) if bias else None

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
        return int(shard)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: output [T, (H + 2 * H_kv) * D]; shard = "q" | "k" | "v"."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def shard_index(self, shard: object) -> int:
        return ("q", "k", "v").index(shard)
