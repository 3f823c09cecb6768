"""Linear layers, including the fused ones that turn 3 (q, k, v) or 2 (gate, up) matmuls into one.

Parameters are allocated uninitialised (weights always come from a checkpoint) and carry a
`weight_loader(param, tensor, shard)` that knows where a checkpoint tensor lands in them. What the
parameters are is the business of the layer's LinearMethod (quantization/base.py): plain weights
here, FP8/int8/int4 ones in quantization/.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.gemv import PROLOGUE_NONE, GemvConfig, gemv, gemv_config
from modeling.layers.quantization import method_for_new_linear
from modeling.layers.quantization.base import ROW_LAYOUT, WEIGHT_LAYOUT, LinearMethod, new_param

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


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class UnquantizedLinearMethod(LinearMethod):
    """The plain weight [out, in] in the model's dtype, applied by `dense`."""

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: list[int], dtype: torch.dtype) -> None:
        new_param(layer, "weight", torch.empty(sum(out_sizes), in_features, dtype=dtype), WEIGHT_LAYOUT)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense(x, layer.weight, bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.weight


class Linear(nn.Module):
    """y = x W^T + b, with W held and applied by a LinearMethod (the quantization scheme's, or plain).

    Sizes are this layer's own (a tensor-parallel rank's share); out_sizes lists fused shards.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.method = method or method_for_new_linear() or UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, self.shard_sizes(), torch.get_default_dtype())
        self.bias = new_param(self, "bias", torch.empty(out_features), ROW_LAYOUT) if bias else None

    def shard_sizes(self) -> list[int]:
        return [self.out_features]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        self.place(param, self.method.to_layout(self.param_name(param), loaded), self.shard_index(shard))

    def shard_index(self, shard: object) -> int:
        """Which fused shard a checkpoint tensor is (0 for a plain Linear)."""
        return 0

    def place(self, param: nn.Parameter, loaded: torch.Tensor, index: int) -> None:
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

    def param_name(self, param: nn.Parameter) -> str:
        return next(name for name, p in self.named_parameters(recurse=False) if p is param)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    @property
    def dense_weight(self) -> torch.Tensor | None:
        """The plain [out, in] weight for fused kernels (kernels.gemv), or None when quantized."""
        return self.method.dense_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; shard = their index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, method: LinearMethod | None = None):
        self.out_sizes = out_sizes  # before super().__init__: create_weights reads shard_sizes()
        super().__init__(in_features, sum(out_sizes), bias, method)

    def shard_sizes(self) -> list[int]:
        return self.out_sizes

    def shard_index(self, shard: object) -> int:
        return int(shard)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: output [T, (H + 2 * H_kv) * D]; shard = "q" | "k" | "v"."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        method: LinearMethod | None = None,
    ):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, method)

    def shard_index(self, shard: object) -> int:
        return ("q", "k", "v").index(shard)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every Linear's method finish its weights (quantize, repack) once the checkpoint is in."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()
