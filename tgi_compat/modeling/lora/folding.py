"""Every slot's LoRA A stacked under a projection's weight, so that at decode sizes the base GEMM / GEMV also
computes each row's shrink for every slot: x @ [W; A_0; ...; A_L-1]^T = [base | shrunk_0 | ... ], and only the expand
(tgi_compat.kernels.lora.expand_folded) is a launch of its own. The extra rows are a few percent of the weight's bytes
(8 slots of r = 16 on Llama-3-8B's q|k|v: 384 rows under 6,144), read in the same pass, where a separate shrink is two
launches' latency a projection; norm and SiLU-and-mul prologues come for free, since the base op applies them.

An FP8 base (e4m3 weight, a scale per output row, activations quantized per token) folds the same way: A's rows are
quantized per row when an adapter is staged, each with its own scale beside the weight's, so the shrink runs in the
FP8 GEMM on the activations it quantized for the base rows (an emulated FP8 weight, dequantized after loading, keeps A
rounded through FP8 the same way). The shrink's relative error is then FP8's (a few percent of the LoRA delta, itself
a small part of the output), the base's own; B and the expand stay in the model's dtype. Measured against the
bf16-shrink path in tests/modeling/test_lora_fp8_fold.py.

The projection keeps its own parameters as views of the first rows of the wide ones: plain steps and prefill read
the same memory as before, and the slot loads write A (and its scales) straight into the extra rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from tgi_compat.modeling.layers.linear import Linear, UnquantizedLinearMethod
from tgi_compat.modeling.layers.quantization.base import layer_tensor
from tgi_compat.modeling.layers.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod

# the parameters with a row per output feature, widened with the weight (an FP8 weight's per-row scale)
_ROW_PARAMS = ("weight", "bias", "weight_scale")


@dataclass(frozen=True, slots=True)
class FoldedA:
    """A projection's widened twin and the slot buffers that are its extra rows."""

    twin: Linear
    a: torch.Tensor  # [extra rows, in]: the twin's weight rows past the projection's (the weight's dtype)
    a_scale: torch.Tensor | None  # [extra rows] float32: their scales (an FP8 weight), None otherwise
    fp8_rounded: bool  # A's rows go through per-row FP8 (an FP8 base, run or emulated)


def fold(proj: Linear, extra_rows: int) -> FoldedA | None:
    """`proj` widened by `extra_rows` rows of A, or None where its base keeps separate A buffers and the segmented
    shrink: another quantization, or an FP8 weight whose widened width is off the 16-column grid of its GEMMs."""
    weight = layer_tensor(proj, "weight")
    if type(proj.method) is UnquantizedLinearMethod and weight.dtype == torch.get_default_dtype():
        twin = widened(proj, extra_rows)
        return FoldedA(twin, layer_tensor(twin, "weight")[proj.out_features :], None, False)
    if isinstance(proj.method, Fp8LinearMethod) and extra_rows % 16 == 0:
        twin = widened(proj, extra_rows)
        rows = proj.out_features
        wide = layer_tensor(twin, "weight")
        scaled = wide.dtype == FP8_DTYPE  # else emulated: the weight dequantized after loading
        a_scale = layer_tensor(twin, "weight_scale")[rows:] if scaled else None
        return FoldedA(twin, wide[rows:], a_scale, True)
    return None


def widened(proj: Linear, extra_rows: int) -> Linear:
    """A twin of `proj` whose per-row parameters have `extra_rows` zero rows under proj's: proj's become views of
    the twin's first rows. The twin runs through the same LayerOps (and the same LinearMethod) as proj."""
    rows = proj.out_features
    twin = copy.copy(proj)  # the same method, slices and tensor-parallel group
    twin._parameters = dict(proj._parameters)  # (a dict of its own: proj's parameters stay proj's)
    for name in _ROW_PARAMS:
        param = proj._parameters.get(name)
        if param is None or param.shape[0] != rows:  # (a per-tensor scale is not per row)
            continue
        wide = torch.zeros(rows + extra_rows, *param.shape[1:], dtype=param.dtype, device=param.device)
        wide[:rows].copy_(param.data)
        param.data = wide[:rows]
        twin._parameters[name] = nn.Parameter(wide, requires_grad=False)
    twin.out_features = rows + extra_rows
    if layer_tensor(proj, "weight").is_cuda:
        # proj's old weight back to the driver now: the next projection's wider weight cannot reuse its block whole,
        # only carve it, and the fragments left would count against the KV cache (sized from the driver's free memory)
        torch.cuda.empty_cache()
    return twin
