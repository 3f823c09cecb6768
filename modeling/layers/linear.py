"""Linear layers, including the fused ones that turn 3 (q, k, v) or 2 (gate, up) matmuls into one.

Parameters are allocated uninitialised (weights always come from a checkpoint) and carry a
`weight_loader(param, tensor, shard)` that knows where a checkpoint tensor lands in them.

Tensor parallelism is a constructor knob: a column-parallel layer keeps a slice of the output rows
(`out_slice`; fused layers: a slice of each part), a row-parallel one a slice of the input columns
(`in_slice`) and returns partial sums that the model all-reduces. The loaders read only that slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.gemv import PROLOGUE_NONE, GemvConfig, gemv, gemv_config
from modeling.parallel import NO_TP, Slice, TensorParallel, shard_heads, split_evenly
from modeling.weights.lazy import LazyTensor, take

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


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
    loaded = take(loaded)
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
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        out_slice: Slice | None = None,
        in_slice: Slice | None = None,
        tp: TensorParallel = NO_TP,
    ):
        """in/out_features: the checkpoint's sizes; out_slice/in_slice: the part this rank keeps."""
        super().__init__()
        self.out_slice, self.in_slice, self.tp = out_slice, in_slice, tp
        self.in_features = in_slice.size if in_slice is not None else in_features
        self.out_features = out_slice.size if out_slice is not None else out_features
        self.weight = new_param(self.out_features, self.in_features, loader=self.load_shard)
        self.bias = new_param(self.out_features, loader=self.load_shard) if bias else None

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
        if self.out_slice is not None:
            loaded = take(loaded, 0, self.out_slice.start, self.out_slice.size)
        elif self.in_slice is not None and param.dim() == 2:
            loaded = take(loaded, 1, self.in_slice.start, self.in_slice.size)
        elif self.in_slice is not None and self.tp.rank > 0:
            loaded = torch.zeros(loaded.shape)  # row-parallel bias: added once, by rank 0, before the sum
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; shard = their index.
    Column-parallel: each rank keeps `part_slices[i]` of projection i (default: an even split)."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool = False,
        *,
        tp: TensorParallel = NO_TP,
        part_slices: list[Slice] | None = None,
    ):
        self.part_slices = part_slices or [split_evenly(size, tp.size, tp.rank) for size in out_sizes]
        local_sizes = [part.size for part in self.part_slices]
        super().__init__(in_features, sum(local_sizes), bias, tp=tp)
        self.offsets = [sum(local_sizes[:i]) for i in range(len(local_sizes))]
        self.out_sizes = local_sizes

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
        index = self.shard_index(shard)
        start, size, part = self.offsets[index], self.out_sizes[index], self.part_slices[index]
        default_weight_loader(param.data.narrow(0, start, size), take(loaded, 0, part.start, part.size))

    def shard_index(self, shard: object) -> int:
        if not isinstance(shard, int):
            raise TypeError(f"{type(self).__name__} shards are numbered, got {shard!r}")
        return shard


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: output [T, (H + 2 * H_kv) * D]; shard = "q" | "k" | "v".
    Column-parallel by head: H and H_kv are this rank's heads (modeling.parallel.shard_heads)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        *,
        tp: TensorParallel = NO_TP,
    ):
        heads = shard_heads(num_heads, num_kv_heads, tp)
        q, kv = heads.q_heads.scaled(head_dim), heads.kv_heads.scaled(head_dim)
        super().__init__(hidden_size, [q.size, kv.size, kv.size], bias, tp=tp, part_slices=[q, kv, kv])

    def shard_index(self, shard: object) -> int:
        return ("q", "k", "v").index(shard)
