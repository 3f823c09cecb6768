"""int4 group-wise weights (W4A16) from AWQ, GPTQ and compressed-tensors `pack-quantized` checkpoints.

Each format packs nibbles its own way; while loading (and sharding) they are all turned into plain
bytes, q uint8 [out, in/2] (low nibble = even input feature), scale and zero [out, in/G] with
w = (q - zero) * scale. After loading the bytes are repacked once into the interleaved int32
[out, in/8] layout that tgi_compat.kernels.gemv.gemv (the few rows of decoding; tgi_compat.kernels.gemv.config.gemv_config_for decides
how few) and tgi_compat.kernels.quant.dequant_matmul (more rows) read (see tgi_compat.kernels.quant.int4_layout). Parameters keep the
checkpoint's names (`qweight`/`qzeros`/`scales`, or `weight_packed`/`weight_scale`) so the model's
loader finds them.

    AWQ (GEMM)   qweight int32 [in, out/8] (nibble order 0 2 4 6 1 3 5 7), qzeros int32 [in/G, out/8], scales [in/G, out]
    GPTQ         qweight int32 [in/8, out], qzeros int32 [in/G, out/8] (stored zero - 1 unless gptq_v2), scales, g_idx [in]
    CT packed    weight_packed int32 [out, in/8] (q + 8), weight_scale [out, in/G], weight_shape [2]; symmetric

A half-precision checkpoint can also be rounded to int4 while loading (`rtn`, LightLLM's triton_w4a16):
asymmetric groups of 128 (64 or 32 where 128 does not divide the inputs), no calibration, so less
accurate than AWQ/GPTQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tgi_compat.kernels.gemv.gemv import few_rows_gemv
from tgi_compat.kernels.gemv.types import QuantizedWeight
from tgi_compat.kernels.quant.dequant_matmul import dequant_matmul, dequant_matmul_ref
from tgi_compat.kernels.quant.int4_layout import int4_period, pack_int4
from tgi_compat.modeling.layers.quantization.base import (
    SHARD_LAYOUT,
    WEIGHT_LAYOUT,
    LinearMethod,
    ParamLayout,
    QuantizationConfig,
    layer_tensor,
    register_param,
)

if TYPE_CHECKING:
    from tgi_compat.modeling.layers.linear import Linear

_AWQ_NATURAL_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # nibble holding column c of each group of 8
_SYMMETRIC_ZERO = 8.0
RTN_GROUP_SIZE = 128  # groups of LightLLM's triton_w4a16 (and AWQ/GPTQ's usual size)


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest, asymmetric: [out, in] -> (q 0..15 [out, in], scale, zero [out, in/G])."""
    w = weight.float().reshape(weight.shape[0], -1, group_size)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = ((high - low) / 15).clamp(min=1e-8)
    zero = (-low / scale).round()
    q = (w / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    return q.reshape(weight.shape).to(torch.uint8), scale, zero


def pack_bytes(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K/2], element 2i in the low nibble of byte i (the loading layout)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_bytes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def unpack_int32_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..., n, ...] -> int32 with dim 8x longer: nibble i of element j becomes element 8j + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    nibbles = nibbles.movedim(-1, dim + 1) if dim >= 0 else nibbles
    shape = list(packed.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [rows, out/8] -> int32 [rows, out] in natural column order."""
    nibbles = unpack_int32_nibbles(packed, 1).view(packed.shape[0], -1, 8)
    return nibbles[:, :, _AWQ_NATURAL_ORDER].reshape(packed.shape[0], -1)


class Int4LinearMethod(LinearMethod):
    name = "int4"

    def __init__(self, checkpoint_format: str, group_size: int, zero_offset: float = 0.0):
        self.format = checkpoint_format  # awq | gptq | pack-quantized | rtn (quantized after loading)
        self.group_size = group_size
        self.zero_offset = zero_offset  # GPTQ v1 stores zero - 1
        self.dtype = torch.float16

    def _names(self) -> tuple[str, str, str | None]:
        """(packed weight, scales, zeros) parameter names in this checkpoint format."""
        if self.format == "pack-quantized":
            return "weight_packed", "weight_scale", None
        return "qweight", "scales", "qzeros"

    def create_weights(self, layer: Linear, in_features: int, out_sizes: list[int], dtype: torch.dtype) -> None:
        if self.format == "rtn":  # the largest usual group that divides this layer's inputs
            self.group_size = next((g for g in (self.group_size, 64, 32) if in_features % g == 0), self.group_size)
        if in_features % self.group_size:
            raise ValueError(f"int4 groups of {self.group_size} do not divide {in_features} input features")
        int4_period(self.group_size)  # refuses groups the kernels' layout cannot hold
        out_features, groups = sum(out_sizes), in_features // self.group_size
        self.dtype = dtype
        if self.format == "rtn":  # filled in dtype, quantized in process_weights_after_loading
            register_param(layer, "weight", torch.empty(out_features, in_features, dtype=dtype), WEIGHT_LAYOUT)
            return
        weight_name, scale_name, zero_name = self._names()
        nibble_bytes = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        register_param(layer, weight_name, nibble_bytes, ParamLayout(output_dim=0, input_dim=1, input_pack=2))
        group_layout = ParamLayout(output_dim=0, input_dim=1, input_pack=self.group_size)
        register_param(layer, scale_name, torch.empty(out_features, groups, dtype=dtype), group_layout)
        if zero_name is not None:
            register_param(layer, zero_name, torch.empty(out_features, groups, dtype=dtype), group_layout)
        if self.format == "gptq":
            register_param(layer, "g_idx", torch.empty(len(out_sizes), in_features, dtype=torch.int32), SHARD_LAYOUT)
        if self.format == "pack-quantized":
            register_param(layer, "weight_shape", torch.empty(len(out_sizes), 2, dtype=torch.int64), SHARD_LAYOUT)

    def to_layout(self, param_name: str, loaded: torch.Tensor) -> torch.Tensor:
        if param_name in ("g_idx", "weight_shape"):
            return loaded
        if self.format == "awq":
            if param_name == "scales":
                return loaded.t()
            columns = _awq_columns(loaded.to(torch.int32)).t()  # [out, in] or [out, in/G]
            return pack_bytes(columns) if param_name == "qweight" else columns
        if self.format == "gptq":
            if param_name == "scales":
                return loaded.t()
            if param_name == "qweight":
                return pack_bytes(unpack_int32_nibbles(loaded.to(torch.int32), 0).t())
            return unpack_int32_nibbles(loaded.to(torch.int32), 1).t() + self.zero_offset
        if param_name == "weight_packed":
            return pack_bytes(unpack_int32_nibbles(loaded.to(torch.int32), 1))
        return loaded

    def process_weights_after_loading(self, layer: Linear) -> None:
        in_features = layer.in_features
        if self.format == "rtn":
            q, scale, zero = quantize_int4_groupwise(layer_tensor(layer, "weight").data, self.group_size)
            del layer.weight
            group_layout = ParamLayout(output_dim=0, input_dim=1, input_pack=self.group_size)
            register_param(layer, "qweight", pack_bytes(q), ParamLayout(output_dim=0, input_dim=1, input_pack=2))
            register_param(layer, "scales", scale.to(self.dtype), group_layout)
            register_param(layer, "qzeros", zero.to(self.dtype), group_layout)
        if self.format == "gptq":
            g_idx = layer_tensor(layer, "g_idx")
            expected = torch.arange(in_features, device=g_idx.device) // self.group_size
            if not torch.equal(g_idx, expected.to(g_idx.dtype).expand_as(g_idx)):
                raise ValueError("GPTQ checkpoints with act-order (desc_act) are not supported")
            del layer.g_idx
        if self.format == "pack-quantized":  # symmetric: the kernel reads a constant zero
            del layer.weight_shape
            zero = torch.full_like(layer_tensor(layer, "weight_scale"), _SYMMETRIC_ZERO)
            register_param(layer, "weight_zero_point", zero, ParamLayout(0, 1, self.group_size))
        weight_name = self._names()[0]  # bytes in, the kernels' interleaved int32 layout out
        packed = pack_int4(unpack_bytes(layer_tensor(layer, weight_name).data), int4_period(self.group_size))
        register_param(layer, weight_name, packed, ParamLayout(output_dim=0, input_dim=1, input_pack=8))

    def tensors(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.format == "pack-quantized":
            return (
                layer_tensor(layer, "weight_packed"),
                layer_tensor(layer, "weight_scale"),
                layer_tensor(layer, "weight_zero_point"),
            )
        return layer_tensor(layer, "qweight"), layer_tensor(layer, "scales"), layer_tensor(layer, "qzeros")

    def gemv_weight(self, layer: Linear) -> QuantizedWeight:
        return QuantizedWeight(*self.tensors(layer), group_size=self.group_size)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale, zero = self.tensors(layer)
        kwargs = dict(bits=4, group_size=self.group_size)
        if not x.is_cuda:
            return dequant_matmul_ref(x, weight, scale, zero, bias, **kwargs)
        out = few_rows_gemv(self.gemv_weight(layer), x, bias)
        if out is not None:
            return out
        return dequant_matmul(x, weight, scale, zero, bias, **kwargs, block_k=min(64, self.group_size))


class Int4Config(QuantizationConfig):
    name = "int4"

    def __init__(self, checkpoint_format: str, group_size: int, zero_offset: float = 0.0):
        self.checkpoint_format = checkpoint_format
        self.group_size = group_size
        self.zero_offset = zero_offset

    @classmethod
    def from_checkpoint(cls, method: str, config: dict) -> Int4Config:
        bits = config.get("bits", config.get("w_bit", 4))
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if bits != 4 or group_size in (None, -1, 0):
            raise ValueError(
                f"{method} checkpoints are supported with 4 bits and a group size (got {bits}, {group_size})"
            )
        if method == "awq":
            if str(config.get("version", "gemm")).lower() != "gemm" or not config.get("zero_point", True):
                raise ValueError("AWQ checkpoints are supported in the GEMM version with zero points")
            return cls("awq", group_size)
        if config.get("desc_act"):
            raise ValueError("GPTQ checkpoints with act-order (desc_act) are not supported")
        is_v2 = config.get("checkpoint_format") == "gptq_v2"
        return cls("gptq", group_size, zero_offset=0.0 if is_v2 else 1.0)

    def linear_method(self) -> LinearMethod:
        return Int4LinearMethod(self.checkpoint_format, self.group_size, self.zero_offset)
