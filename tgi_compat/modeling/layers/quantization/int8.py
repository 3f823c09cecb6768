"""int8 weights, one scale per output channel: weight-only (W8A16) or with per-token int8 activations (W8A8).

Sources: a half-precision checkpoint quantized while loading (`--quantize eetq`, AIAK's
`weight_only_int8`), or a compressed-tensors `naive-quantized`/`int-quantized` checkpoint (`weight`
int8 [out, in], `weight_scale` [out, 1]; W8A8 ones are what SmoothQuant writes, the smoothing already
folded into the norms before).

On CUDA the few rows of decoding (tgi_compat.kernels.gemv.config.gemv_config_for decides how few) run tgi_compat.kernels.gemv.gemv, which
dequantizes the int8 weight in registers; more rows run tgi_compat.kernels.quant.dequant_matmul (W8A16) or, for W8A8,
`torch._int_mm` above 16 rows (its limit; 9..16 rows take dequant_matmul). Both weight-only kernels skip
W8A8's activation rounding. On CPU both schemes run their torch reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tgi_compat.kernels.gemv.gemv import few_rows_gemv
from tgi_compat.kernels.gemv.types import QuantizedWeight
from tgi_compat.kernels.quant.dequant_matmul import dequant_matmul
from tgi_compat.kernels.quant.per_token import INT8_MAX, quant_per_token, quant_per_token_ref
from tgi_compat.modeling.layers.quantization.base import (
    ROW_LAYOUT,
    WEIGHT_LAYOUT,
    LinearMethod,
    QuantizationConfig,
    layer_tensor,
    register_param,
)

if TYPE_CHECKING:
    from tgi_compat.modeling.layers.linear import Linear

_INT_MM_MIN_ROWS = 17


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in], float32 scale [out]), symmetric per channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_linear_ref(x, weight, weight_scale, bias=None, quantize_activations: bool = False) -> torch.Tensor:
    """fp32 product of (x, or x rounded per token to int8) and the dequantized weight, in x's dtype."""
    xf = x.float()
    if quantize_activations:
        xq, x_scale = quant_per_token_ref(x, torch.int8)
        xf = xq.float() * x_scale
    out = F.linear(xf, weight.float()) * weight_scale.float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


class Int8LinearMethod(LinearMethod):
    name = "int8"

    def __init__(self, is_serialized: bool, quantize_activations: bool = False):
        self.is_serialized = is_serialized
        self.quantize_activations = quantize_activations

    def create_weights(self, layer: Linear, in_features: int, out_sizes: list[int], dtype: torch.dtype) -> None:
        out_features = sum(out_sizes)
        if not self.is_serialized:
            register_param(layer, "weight", torch.empty(out_features, in_features, dtype=dtype), WEIGHT_LAYOUT)
            return
        register_param(layer, "weight", torch.empty(out_features, in_features, dtype=torch.int8), WEIGHT_LAYOUT)
        register_param(layer, "weight_scale", torch.empty(out_features, dtype=torch.float32), ROW_LAYOUT)

    def to_layout(self, param_name: str, loaded: torch.Tensor) -> torch.Tensor:
        if param_name == "weight_scale":
            return loaded.float().reshape(()) if loaded.numel() == 1 else loaded.float().reshape(-1)
        return loaded

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not self.is_serialized:
            weight, scale = quantize_weight_int8(layer_tensor(layer, "weight").data)
            register_param(layer, "weight", weight, WEIGHT_LAYOUT)
            register_param(layer, "weight_scale", scale, ROW_LAYOUT)

    def gemv_weight(self, layer: Linear) -> QuantizedWeight:
        return QuantizedWeight(layer_tensor(layer, "weight"), layer_tensor(layer, "weight_scale"))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not x.is_cuda:
            return int8_linear_ref(x, layer.weight, layer.weight_scale, bias, self.quantize_activations)
        out = few_rows_gemv(self.gemv_weight(layer), x, bias)
        if out is not None:
            return out
        if self.quantize_activations and x.shape[0] >= _INT_MM_MIN_ROWS:
            x_q, x_scale = quant_per_token(x, torch.int8)
            out = (
                torch._int_mm(x_q, layer_tensor(layer, "weight").t()).float()
                * x_scale
                * layer_tensor(layer, "weight_scale")
            )
            if bias is not None:
                out += bias.float()
            return out.to(x.dtype)
        return dequant_matmul(x, layer_tensor(layer, "weight"), layer_tensor(layer, "weight_scale"), bias=bias, bits=8)


class Int8Config(QuantizationConfig):
    name = "int8"

    def __init__(self, is_serialized: bool = False, quantize_activations: bool = False):
        self.is_serialized = is_serialized
        self.quantize_activations = quantize_activations

    def linear_method(self) -> LinearMethod:
        return Int8LinearMethod(self.is_serialized, self.quantize_activations)
