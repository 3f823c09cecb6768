"""Every slot's LoRA A stacked under a dense projection's weight, so that at decode sizes the base GEMM / GEMV also
computes each row's shrink for every slot: x @ [W; A_0; ...; A_L-1]^T = [base | shrunk_0 | ... ], and only the expand
(tgi_compat.kernels.lora.expand_folded) is a launch of its own. The extra rows are a few percent of the weight's bytes
(8 slots of r = 16 on Llama-3-8B's q|k|v: 384 rows under 6,144), read in the same pass, where a separate shrink is two
launches' latency a projection; norm and SiLU-and-mul prologues come for free, since the base op applies them.

The projection keeps its own weight and bias as views of the first rows of the wide ones: plain steps and prefill
read the same memory as before, and the slot loads write A straight into its rows.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tgi_compat.modeling.layers.linear import Linear, UnquantizedLinearMethod
from tgi_compat.modeling.layers.quantization.base import layer_tensor


def can_fold(proj: Linear) -> bool:
    """A plain weight in the LoRA buffers' dtype (a quantized base keeps separate A buffers and the shrink kernel)."""
    return (
        type(proj.method) is UnquantizedLinearMethod and layer_tensor(proj, "weight").dtype == torch.get_default_dtype()
    )


def widened(proj: Linear, extra_rows: int) -> Linear:
    """A twin of `proj` whose weight has `extra_rows` zero rows under proj's (its bias, zeros after proj's): proj's
    weight and bias become views of the twin's first rows. The twin runs through the same LayerOps as proj."""
    weight = layer_tensor(proj, "weight")
    rows, columns = weight.shape
    wide = torch.zeros(rows + extra_rows, columns, dtype=weight.dtype, device=weight.device)
    wide[:rows].copy_(weight)
    weight.data = wide[:rows]
    twin = copy.copy(proj)  # the same method, slices and tensor-parallel group
    twin._parameters = dict(proj._parameters)  # (a dict of its own: proj's parameters stay proj's)
    twin._parameters["weight"] = nn.Parameter(wide, requires_grad=False)
    if proj.bias is not None:
        wide_bias = torch.zeros(rows + extra_rows, dtype=proj.bias.dtype, device=proj.bias.device)
        wide_bias[:rows].copy_(proj.bias)
        proj.bias.data = wide_bias[:rows]
        twin._parameters["bias"] = nn.Parameter(wide_bias, requires_grad=False)
    twin.out_features = rows + extra_rows
    if wide.is_cuda:
        # proj's old weight back to the driver now: the next projection's wider weight cannot reuse its block whole,
        # only carve it, and the fragments left would count against the KV cache (sized from the driver's free memory)
        torch.cuda.empty_cache()
    return twin
