"""Linear layers, including the fused ones that turn 3 (q, k, v) or 2 (gate, up) matmuls into one.

Parameters are allocated uninitialised (weights always come from a checkpoint) and carry a
`weight_loader(param, tensor, shard)` that knows where a checkpoint tensor lands in them. What the
parameters are is the business of the layer's LinearMethod (quantization/base.py): plain weights
here, FP8/int8/int4 ones in quantization/.

Tensor parallelism is a constructor knob: a column-parallel layer keeps a slice of the output rows
(`out_slice`; fused layers: a slice of each part), a row-parallel one a slice of the input columns
(`in_slice`) and returns partial sums that the model all-reduces. The loaders read only that slice.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tgi_compat.kernels.gemv.config import gemv_config_for
from tgi_compat.kernels.gemv.gemv import gemv
from tgi_compat.kernels.gemv.types import PROLOGUE_NONE, QuantizedWeight
from tgi_compat.modeling.layers.quantization import method_for_new_linear
from tgi_compat.modeling.layers.quantization.base import (
    ROW_LAYOUT,
    WEIGHT_LAYOUT,
    LinearMethod,
    LoadableParameter,
    WeightLoader,
    layer_tensor,
    register_param,
)
from tgi_compat.modeling.parallel import NO_TP, Slice, TensorParallel, shard_heads, split_evenly
from tgi_compat.modeling.weights.lazy import LazyTensor, take

# On CPU, oneDNN's matmul runs the few-row products of decoding 1.3-2x faster than F.linear's MKL
# GEMV (2-core AVX2 VM, float32: LM head 49152x576 at 1 row 6.2 vs 9.7 ms, gate|up 3072x576 0.37 vs
# 0.66 ms), and loses a little on prefill-sized inputs; so only rows <= this take it.
_ONEDNN_MAX_ROWS = 16
_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: F.linear; oneDNN for few-row float32 inputs on CPU; tgi_compat.kernels.gemv.gemv for one
    half-precision row on CUDA (batch-1 decode), where it reads the weight faster than cuBLAS."""
    if x.is_cuda:
        config = gemv_config_for(x, weight, PROLOGUE_NONE)
        if config is not None:
            return gemv(x, weight, bias, config=config)
    elif _onednn_linear is not None and x.dtype == torch.float32 and x.shape[0] <= _ONEDNN_MAX_ROWS:
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
    loaded = take(loaded)
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def new_param(*shape: int, loader: WeightLoader = default_weight_loader) -> LoadableParameter:
    param = LoadableParameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class UnquantizedLinearMethod(LinearMethod):
    """The plain weight [out, in] in the model's dtype, applied by `dense`."""

    def create_weights(self, layer: Linear, in_features: int, out_sizes: list[int], dtype: torch.dtype) -> None:
        register_param(layer, "weight", torch.empty(sum(out_sizes), in_features, dtype=dtype), WEIGHT_LAYOUT)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense(x, layer_tensor(layer, "weight"), bias)

    def gemv_weight(self, layer: Linear) -> torch.Tensor | QuantizedWeight | None:
        return layer_tensor(layer, "weight")


class Linear(nn.Module):
    """y = x W^T + b, with W held and applied by a LinearMethod (the quantization scheme's, or plain).

    in/out_features are the checkpoint's sizes; out_slice / in_slice the part this tensor-parallel
    rank keeps (column- / row-parallel). The parameters hold only that part.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        method: LinearMethod | None = None,
        *,
        out_slice: Slice | None = None,
        in_slice: Slice | None = None,
        tp: TensorParallel = NO_TP,
        part_slices: list[Slice] | None = None,  # MergedLinear's: each projection's rows on this rank
        full_out_sizes: list[int] | None = None,  # MergedLinear's: each projection's unsharded size
    ):
        super().__init__()
        self.tp, self.in_slice = tp, in_slice
        self.part_slices = part_slices if part_slices is not None else [out_slice] if out_slice is not None else None
        self.full_out_sizes = full_out_sizes or [out_features]
        self.full_in_features = in_features
        self.in_features = in_slice.size if in_slice is not None else in_features
        self.out_features = out_slice.size if out_slice is not None else out_features
        self.method = method or method_for_new_linear() or UnquantizedLinearMethod()
        self.method.create_weights(self, self.in_features, self.shard_sizes(), torch.get_default_dtype())
        self.bias = register_param(self, "bias", torch.empty(self.out_features), ROW_LAYOUT) if bias else None

    def shard_sizes(self) -> list[int]:
        return [self.out_features]

    def load_shard(self, param: LoadableParameter, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
        index = self.shard_index(shard)
        if not isinstance(self.method, UnquantizedLinearMethod):
            loaded = self.method.to_layout(self.param_name(param), take(loaded))
        self.place(param, self.rank_part(param, loaded, index), index)

    def rank_part(self, param: LoadableParameter, loaded: torch.Tensor | LazyTensor, index: int) -> torch.Tensor:
        """This rank's part of a checkpoint tensor already in the method's layout: scaled from the
        layer's slices by the tensor's own extent along the sliced dim (packed or grouped dims too)."""
        layout = param.param_layout
        if not self.tp.is_sharded or len(loaded.shape) == 0:
            return take(loaded)
        if self.part_slices is not None and layout.output_dim is not None:
            part, full = self.part_slices[index], self.full_out_sizes[index]
            extent = loaded.shape[layout.output_dim]
            return take(loaded, layout.output_dim, part.start * extent // full, part.size * extent // full)
        if self.in_slice is not None and layout.input_dim is not None:
            extent = loaded.shape[layout.input_dim]
            start = self.in_slice.start * extent // self.full_in_features
            return take(loaded, layout.input_dim, start, self.in_slice.size * extent // self.full_in_features)
        if self.in_slice is not None and param is self.bias and self.tp.rank > 0:
            return torch.zeros(loaded.shape)  # row-parallel bias: added once, by rank 0, before the sum
        return take(loaded)

    def shard_index(self, shard: object) -> int:
        """Which fused shard a checkpoint tensor is (0 for a plain Linear)."""
        return 0

    def place(self, param: LoadableParameter, loaded: torch.Tensor, index: int) -> None:
        """Copy one fused shard's tensor (already in the method's layout) into its part of param."""
        target = param.data
        if param.param_layout.output_dim is None:  # one value per shard
            target = target.narrow(0, index, 1) if target.dim() and target.shape[0] > 1 else target
            target.copy_(loaded.reshape(target.shape))
            return
        if len(self.shard_sizes()) > 1:
            start = sum(self.shard_sizes()[:index])
            target = target.narrow(param.param_layout.output_dim, start, self.shard_sizes()[index])
        if loaded.dim() == 0:  # a per-tensor value for a per-row parameter
            target.fill_(loaded)
        else:
            default_weight_loader(target, loaded)

    def param_name(self, param: LoadableParameter) -> str:
        return next(name for name, p in self.named_parameters(recurse=False) if p is param)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    @property
    def gemv_weight(self) -> torch.Tensor | QuantizedWeight | None:
        """The weight fused decode kernels (tgi_compat.kernels.gemv.gemv) read: plain, quantized with its scales, or None."""
        return self.method.gemv_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    @property
    def takes_fp8_activations(self) -> bool:
        """Whether `forward_fp8` may be given per-token FP8 activations instead of `forward`'s half precision."""
        return self.method.takes_fp8_activations(self)

    def forward_fp8(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self.method.apply_fp8(self, x_q, x_scale, self.bias, out_dtype)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; shard = their index.
    Column-parallel: each rank keeps `part_slices[i]` of projection i (default: an even split)."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool = False,
        method: LinearMethod | None = None,
        *,
        tp: TensorParallel = NO_TP,
        part_slices: list[Slice] | None = None,
    ):
        parts = part_slices or [split_evenly(size, tp.size, tp.rank) for size in out_sizes]
        self.out_sizes = [part.size for part in parts]  # before super().__init__: create_weights reads shard_sizes()
        super().__init__(
            in_features, sum(self.out_sizes), bias, method, tp=tp, part_slices=parts, full_out_sizes=out_sizes
        )

    def shard_sizes(self) -> list[int]:
        return self.out_sizes

    def shard_index(self, shard: object) -> int:
        if not isinstance(shard, int):
            raise TypeError(f"{type(self).__name__} shards are numbered, got {shard!r}")
        return shard


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: output [T, (H + 2 * H_kv) * D]; shard = "q" | "k" | "v".
    Column-parallel by head: H and H_kv are this rank's heads (tgi_compat.modeling.parallel.shard_heads)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        method: LinearMethod | None = None,
        *,
        tp: TensorParallel = NO_TP,
    ):
        heads = shard_heads(num_heads, num_kv_heads, tp)
        q, kv = heads.q_heads.scaled(head_dim), heads.kv_heads.scaled(head_dim)
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, method, tp=tp, part_slices=[q, kv, kv])

    def shard_index(self, shard: object) -> int:
        return ("q", "k", "v").index(shard)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every Linear's method finish its weights (quantize, repack) once the checkpoint is in."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()
