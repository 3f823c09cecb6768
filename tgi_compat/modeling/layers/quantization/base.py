"""The quantized-linear seam: one `LinearMethod` object per scheme owns a Linear's weights.

A method creates the layer's parameters (in the layer's *local* sizes, so tensor parallelism shards
a quantized layer the same way as a plain one), turns checkpoint tensors into its own layout while
they load, finishes them after loading (e.g. quantizing a bf16 weight to FP8), and runs the matmul.
Models and the TP loaders never look inside: they see `Linear(in, out)` and `param.weight_loader`.

Every parameter a method creates carries a `ParamLayout` (`param.param_layout`) saying which of its dims index the output
features and the input features (and how many features one stored element covers along the input),
which is all a sharding loader needs to cut a quantized tensor for its rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn

from tgi_compat.modeling.weights.lazy import LazyTensor

if TYPE_CHECKING:
    from tgi_compat.kernels.gemv.types import QuantizedWeight
    from tgi_compat.modeling.layers.linear import Linear


@dataclass(frozen=True, slots=True)
class ParamLayout:
    output_dim: int | None = 0  # dim indexed by output features (None: one value per fused shard or layer)
    input_dim: int | None = None  # dim indexed by input features (None: not split by input)
    input_pack: int = 1  # input features per element along input_dim (8 for int4 packed in int32, g for group scales)


WEIGHT_LAYOUT = ParamLayout(output_dim=0, input_dim=1)
ROW_LAYOUT = ParamLayout(output_dim=0)  # bias, per-channel scales
SHARD_LAYOUT = ParamLayout(output_dim=None)  # one value per fused shard (per-tensor scales)


class LoadableParameter(nn.Parameter):
    """A parameter that carries the loader placing a checkpoint tensor in it, and (a Linear's) its layout."""

    weight_loader: WeightLoader
    param_layout: ParamLayout


# (param, checkpoint tensor, shard); the tensor may be lazy (tensor parallelism reads each rank's slice)
WeightLoader = Callable[[LoadableParameter, torch.Tensor | LazyTensor, object], None]


def register_param(layer: Linear, name: str, tensor: torch.Tensor, layout: ParamLayout) -> LoadableParameter:
    """Register `tensor` as a frozen parameter of `layer`, loaded through the layer's load_shard."""
    param = LoadableParameter(tensor, requires_grad=False)
    param.param_layout = layout
    param.weight_loader = layer.load_shard
    layer.register_parameter(name, param)
    return param


def layer_tensor(layer: Linear, name: str) -> torch.Tensor:
    """A parameter a method registered on `layer` (nn.Module's __getattr__ is typed Tensor | Module)."""
    return cast(torch.Tensor, getattr(layer, name))


class LinearMethod(ABC):
    """How one quantization scheme stores, loads and applies a Linear's weight."""

    name: str = "unquantized"

    @abstractmethod
    def create_weights(self, layer: Linear, in_features: int, out_sizes: list[int], dtype: torch.dtype) -> None:
        """Register the parameters on `layer` (local sizes; out_sizes: one entry per fused shard)."""

    def to_layout(self, param_name: str, loaded: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (one fused shard's, unsharded) in this method's layout for `param_name`."""
        return loaded

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 (optional hook)
        """Last step after every tensor is in: quantize, transpose, pack for the kernel."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""

    def takes_fp8_activations(self, layer: Linear) -> bool:
        """Whether `apply_fp8` runs this layer on activations already quantized per token to FP8, so that the
        kernel before the projection (RMSNorm, SiLU-and-mul) can write them directly."""
        return False

    def apply_fp8(
        self, layer: Linear, x_q: torch.Tensor, x_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """x_q float8_e4m3fn [T, in] with x_scale float32 [T, 1] -> [T, out] in out_dtype."""
        raise NotImplementedError(f"{self.name} takes half-precision activations")

    def gemv_weight(self, layer: Linear) -> torch.Tensor | QuantizedWeight | None:
        """The weight tgi_compat.kernels.gemv.gemv reads for the few rows of decoding (with the norm or SiLU-mul before the
        projection fused in): the plain [out, in] weight, or a quantized one with its scales; None: none."""
        return None


class QuantizationConfig(ABC):
    """A scheme chosen once at startup (flag or checkpoint): hands each Linear its method."""

    name: str

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """A fresh method object for one Linear (methods may keep per-layer state)."""
