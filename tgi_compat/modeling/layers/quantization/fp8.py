"""FP8 weights (e4m3, one scale per output channel) with dynamic per-token FP8 activations.

Two sources: a half-precision checkpoint quantized while loading (`--quantize fp8`), or an FP8
checkpoint loaded as it is (compressed-tensors `float-quantized`, TGI/transformers `fp8`, FBGEMM
`fbgemm_fp8`): `weight` float8_e4m3fn [out, in] and `weight_scale` per tensor ([] / [1]) or per
channel ([out] / [out, 1]). A per-tensor scale of a fused shard (q, k, v) becomes that shard's rows of
the per-channel scale, which is exact. A static `input_scale` is loaded but not used: activations are
always scaled per token at run time, which is at least as accurate.

On GPUs with FP8 tensor cores (compute capability >= 8.9) the product is `torch._scaled_mm` with
row-wise scales above tgi_compat.kernels.quant.fp8_gemm.MAX_ROWS rows, and tgi_compat.kernels.quant.fp8_gemm's weight-streaming FP8 GEMM at
the few dozen rows of batched decoding, except for the fewest rows (tgi_compat.kernels.gemv.config.gemv_config_for decides how few): there the
GEMV reads the FP8 weight and dequantizes it in registers, with the activations left in half precision
(W8A16: reading half the bytes is the whole gain there, and quantizing the activations would be an
extra kernel and an extra rounding). Above those rows the FP8 activations of the q|k|v, gate|up and down
projections come straight out of the RMSNorm / SiLU-and-mul kernel before them (`apply_fp8`,
tgi_compat/modeling/layers/triton_ops.py): no quantization launch of their own. Elsewhere the weight is
dequantized once after loading and the same arithmetic is emulated (activations rounded through FP8
per token, product in fp32): the numbers are FP8's, the memory and the speed are the unquantized
model's (logged once).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tgi_compat.kernels.gemv.gemv import few_rows_gemv
from tgi_compat.kernels.gemv.types import QuantizedWeight
from tgi_compat.kernels.quant.fp8_gemm import MAX_ROWS as FP8_GEMM_MAX_ROWS
from tgi_compat.kernels.quant.fp8_gemm import fp8_gemm
from tgi_compat.kernels.quant.per_token import FP8_E4M3_MAX, quant_per_token, quant_per_token_ref
from tgi_compat.modeling.layers.quantization.base import (
    ROW_LAYOUT,
    SHARD_LAYOUT,
    WEIGHT_LAYOUT,
    LinearMethod,
    QuantizationConfig,
    layer_tensor,
    register_param,
)

if TYPE_CHECKING:
    from tgi_compat.modeling.layers.linear import Linear

logger = logging.getLogger(__name__)
FP8_DTYPE = torch.float8_e4m3fn


@functools.cache
def device_has_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _log_emulation_once(device_type: str) -> None:
    logger.warning(
        "FP8 on %s: this device has no FP8 matmul, so FP8 weights are dequantized after loading and FP8 "
        "activations emulated: FP8's accuracy, without its memory saving or speed-up",
        device_type,
    )


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], float32 scale [out]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_E4M3_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * weight_scale.float()[:, None]


class Fp8LinearMethod(LinearMethod):
    name = "fp8"

    def __init__(self, is_serialized: bool, has_input_scale: bool = False):
        self.is_serialized = is_serialized  # FP8 in the checkpoint (else: quantize after loading)
        self.has_input_scale = has_input_scale
        self.use_scaled_mm = False
        self.dtype = torch.float32  # the model's, for the dequantized weight of the emulation

    def create_weights(self, layer: Linear, in_features: int, out_sizes: list[int], dtype: torch.dtype) -> None:
        out_features = sum(out_sizes)
        self.dtype = dtype
        if not self.is_serialized:  # filled in dtype, quantized in process_weights_after_loading
            register_param(layer, "weight", torch.empty(out_features, in_features, dtype=dtype), WEIGHT_LAYOUT)
            return
        register_param(layer, "weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE), WEIGHT_LAYOUT)
        register_param(layer, "weight_scale", torch.empty(out_features, dtype=torch.float32), ROW_LAYOUT)
        if self.has_input_scale:
            register_param(layer, "input_scale", torch.empty(len(out_sizes), dtype=torch.float32), SHARD_LAYOUT)

    def to_layout(self, param_name: str, loaded: torch.Tensor) -> torch.Tensor:
        if param_name == "weight_scale":  # [] / [1] per tensor (a scalar fills the shard), [out(, 1)] per channel
            return loaded.float().reshape(()) if loaded.numel() == 1 else loaded.float().reshape(-1)
        if param_name == "input_scale":
            return loaded.float().reshape(-1)
        return loaded

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not self.is_serialized:
            weight, scale = quantize_weight_per_channel(layer_tensor(layer, "weight").data)
            register_param(layer, "weight", weight, WEIGHT_LAYOUT)  # replaces the half-precision one
            register_param(layer, "weight_scale", scale, ROW_LAYOUT)
        out_features, in_features = layer_tensor(layer, "weight").shape
        device = layer_tensor(layer, "weight").device
        self.use_scaled_mm = device_has_fp8_matmul(device) and out_features % 16 == 0 and in_features % 16 == 0
        if not self.use_scaled_mm:
            _log_emulation_once(device.type)
            dequantized = dequantize_fp8(
                layer_tensor(layer, "weight").data, layer_tensor(layer, "weight_scale").data
            ).to(self.dtype)
            register_param(layer, "weight", dequantized, WEIGHT_LAYOUT)

    def gemv_weight(self, layer: Linear) -> QuantizedWeight | None:
        if not self.use_scaled_mm:  # emulation: the weight is dequantized, the activations must be rounded
            return None
        return QuantizedWeight(layer_tensor(layer, "weight"), layer_tensor(layer, "weight_scale"))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.use_scaled_mm:
            x_q, x_scale = quant_per_token_ref(x, FP8_DTYPE)
            return self.apply_fp8(layer, x_q, x_scale, bias, x.dtype)
        out = few_rows_gemv(self.gemv_weight(layer), x, bias)
        if out is not None:
            return out
        x_q, x_scale = quant_per_token(x, FP8_DTYPE)
        return self.apply_fp8(layer, x_q, x_scale, bias, x.dtype)

    def takes_fp8_activations(self, layer: Linear) -> bool:
        return True  # _scaled_mm's input, or the emulation's rounded activations

    def apply_fp8(
        self, layer: Linear, x_q: torch.Tensor, x_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        if not self.use_scaled_mm:  # emulation: the product in fp32 with the dequantized weight
            out = F.linear(x_q.float() * x_scale, layer_tensor(layer, "weight").float())
            return (out if bias is None else out + bias.float()).to(out_dtype)
        if x_q.shape[0] <= FP8_GEMM_MAX_ROWS:  # a decode step's few dozen rows: our weight-streaming kernel
            weight, weight_scale = layer_tensor(layer, "weight"), layer_tensor(layer, "weight_scale")
            return fp8_gemm(x_q, x_scale, weight, weight_scale, bias, out_dtype)
        # Row-wise scaled FP8 GEMM (bf16 output only, so fp16 models convert back). Fast accumulation (no
        # periodic promotion of the tensor cores' partial sums to fp32) as vLLM's CUTLASS FP8 kernels run.
        out = torch._scaled_mm(
            x_q,
            layer_tensor(layer, "weight").t(),
            scale_a=x_scale,
            scale_b=layer_tensor(layer, "weight_scale").view(1, -1),
            bias=bias if bias is not None and bias.dtype == torch.bfloat16 else None,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
        if bias is not None and bias.dtype != torch.bfloat16:
            out = out + bias
        return out.to(out_dtype)


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, is_serialized: bool = False, has_input_scale: bool = False):
        self.is_serialized = is_serialized
        self.has_input_scale = has_input_scale

    @classmethod
    def from_checkpoint(cls, quant_config: dict) -> Fp8Config:
        """TGI/transformers `fp8` or `fbgemm_fp8` quantization_config."""
        return cls(is_serialized=True, has_input_scale=quant_config.get("activation_scheme") == "static")

    def linear_method(self) -> LinearMethod:
        return Fp8LinearMethod(self.is_serialized, self.has_input_scale)
