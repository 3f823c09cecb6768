"""compressed-tensors checkpoints (llm-compressor's format, also what `tgi_compat.quantize` writes).

`quantization_config.config_groups` names the weight (and activation) scheme of the Linear layers;
one scheme for all of them is supported, picked here to the method that runs it:

    weights float 8 bit                      -> fp8.Fp8LinearMethod (per tensor or per channel)
    weights int 8 bit per channel            -> int8.Int8LinearMethod (W8A16, or W8A8 with token-dynamic int8 activations)
    weights int 4 bit per group, symmetric   -> int4.Int4LinearMethod (`pack-quantized`)
"""

from __future__ import annotations

from typing import Any

from tgi_compat.modeling.layers.quantization.base import QuantizationConfig


def compressed_tensors_config(config: dict[str, Any]) -> QuantizationConfig:
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (need 1)")
    ignored = [name for name in config.get("ignore") or [] if not name.endswith("lm_head")]
    if ignored:
        raise ValueError(f"compressed-tensors `ignore` beyond lm_head is not supported: {ignored[:4]}")
    weights = groups[0].get("weights") or {}
    activations = groups[0].get("input_activations")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if kind == "float" and bits == 8:
        from tgi_compat.modeling.layers.quantization.fp8 import Fp8Config

        has_input_scale = bool(activations) and not activations.get("dynamic", False)
        return Fp8Config(is_serialized=True, has_input_scale=has_input_scale)
    if kind == "int" and bits == 8 and strategy == "channel" and weights.get("symmetric", True):
        from tgi_compat.modeling.layers.quantization.int8 import Int8Config

        if activations and not (activations.get("dynamic") and activations.get("num_bits") == 8):
            raise ValueError("int8 compressed-tensors checkpoints need no or dynamic int8 activation quantization")
        return Int8Config(is_serialized=True, quantize_activations=bool(activations))
    if kind == "int" and bits == 4 and strategy == "group" and weights.get("symmetric", True) and not activations:
        from tgi_compat.modeling.layers.quantization.int4 import Int4Config

        return Int4Config("pack-quantized", int(weights["group_size"]))
    raise ValueError(f"unsupported compressed-tensors weight scheme {weights} with activations {activations}")
