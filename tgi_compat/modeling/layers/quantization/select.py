"""Which scheme runs: from the checkpoint's config.json `quantization_config`, else `--quantize`.

A checkpoint that is already quantized decides (a `--quantize` naming another scheme is an error);
an unquantized one is quantized while loading when the scheme can do that (fp8, int8 weight-only).
Every refusal names what would work.
"""

from __future__ import annotations

from typing import Any

from tgi_compat.modeling.layers.quantization.base import QuantizationConfig

# Scheme names: TGI's --quantize values, AIAK's --quantization ones (weight_only_int8, smooth_quant)
# and the ones LightLLM's --mode implies (w8a8_int8, w4a16_int4).
# Those that quantize an unquantized checkpoint while it loads:
ON_THE_FLY = ("fp8", "eetq", "weight_only_int8", "w8a8_int8", "w4a16_int4")
# Those that only describe a checkpoint quantized beforehand:
FROM_CHECKPOINT = ("awq", "gptq", "compressed-tensors", "smooth_quant")
# the checkpoint quant_method values each scheme name accepts (a quantized checkpoint decides)
_FLAG_ACCEPTS = {
    "fp8": {"fp8", "fbgemm_fp8", "compressed-tensors"},
    "awq": {"awq"},
    "gptq": {"gptq"},
    "compressed-tensors": {"compressed-tensors"},
    "smooth_quant": {"compressed-tensors"},
    "weight_only_int8": {"compressed-tensors"},
    "w8a8_int8": {"compressed-tensors"},
    "w4a16_int4": {"awq", "gptq", "compressed-tensors"},
}


class QuantizationError(ValueError):
    pass


def resolve_quantization(flag: str | None, checkpoint_config: dict[str, Any] | None) -> QuantizationConfig | None:
    if checkpoint_config:
        return _from_checkpoint(flag, checkpoint_config)
    if flag is None:
        return None
    if flag == "fp8":
        from tgi_compat.modeling.layers.quantization.fp8 import Fp8Config

        return Fp8Config(is_serialized=False)
    if flag in ("eetq", "weight_only_int8", "w8a8_int8"):
        from tgi_compat.modeling.layers.quantization.int8 import Int8Config

        return Int8Config(is_serialized=False, quantize_activations=flag == "w8a8_int8")
    if flag == "w4a16_int4":
        from tgi_compat.modeling.layers.quantization.int4 import RTN_GROUP_SIZE, Int4Config

        return Int4Config("rtn", RTN_GROUP_SIZE)
    if flag in FROM_CHECKPOINT:
        raise QuantizationError(
            f"--quantize {flag} needs a checkpoint quantized with {flag} (config.json `quantization_config`); "
            f"this one is not quantized. Quantize it with `python -m tgi_compat.quantize`, or use --quantize "
            f"fp8 or eetq to quantize while loading"
        )
    raise QuantizationError(f"--quantize {flag} is not supported (supported: {', '.join(supported_flags())})")


def supported_flags() -> list[str]:
    return sorted(set(ON_THE_FLY) | set(FROM_CHECKPOINT))


def _from_checkpoint(flag: str | None, config: dict[str, Any]) -> QuantizationConfig:
    method = str(config.get("quant_method", "")).lower()
    if flag is not None and method not in _FLAG_ACCEPTS.get(flag, ()):
        raise QuantizationError(f"--quantize {flag} was given but the checkpoint is quantized with {method!r}")
    if method in ("fp8", "fbgemm_fp8"):
        from tgi_compat.modeling.layers.quantization.fp8 import Fp8Config

        return Fp8Config.from_checkpoint(config)
    if method == "compressed-tensors":
        from tgi_compat.modeling.layers.quantization.compressed_tensors import compressed_tensors_config

        return compressed_tensors_config(config)
    if method in ("awq", "gptq"):
        from tgi_compat.modeling.layers.quantization.int4 import Int4Config

        return Int4Config.from_checkpoint(method, config)
    raise QuantizationError(
        f"the checkpoint is quantized with {method!r}, which is not supported "
        "(supported: fp8, fbgemm_fp8, compressed-tensors, awq, gptq)"
    )
