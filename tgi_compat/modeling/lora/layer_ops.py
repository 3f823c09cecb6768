"""The model's LayerOps with LoRA: the ops that end in a projection add each LoRA row's low-rank product.

Built once, when LoRA is enabled, around the ops chosen at startup. A step without a LoRA row (context.step
None) takes the base op unchanged, fused kernels and all; a step with one runs its projections unfused (the
norm, then the base projection once for every row, then the segmented shrink and expand), since the fused
kernels never hand out the activations the adapters need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.ops import LayerOps, sum_later, sum_now, torch_silu_and_mul
from tgi_compat.modeling.lora.step import LoraStep
from tgi_compat.modeling.lora.weights import LoraWeights
from tgi_compat.modeling.parallel import TensorParallel


@dataclass(slots=True)
class LoraContext:
    """What every layer of a LoRA-enabled model reads: the current step's segments, None in a plain step."""

    step: LoraStep | None = None


def lora_layer_ops(base: LayerOps, context: LoraContext, targets: dict[Linear, LoraWeights]) -> LayerOps:
    def projected(proj: Linear, x: torch.Tensor, step: LoraStep) -> torch.Tensor:
        return targets[proj].add_to(proj(x), x, step)

    def rms_norm_linear(x, residual, norm, proj: Linear, sum_over: TensorParallel | None = None):
        step = context.step
        if step is None or proj not in targets:
            return base.rms_norm_linear(x, residual, norm, proj, sum_over)
        x = sum_now(x, sum_over)
        normed, summed = norm(x, residual)
        return projected(proj, normed, step), (x if residual is None else summed)

    def norm_add_norm_linear(x, x_norm, residual, norm, proj: Linear):
        step = context.step
        if step is None or proj not in targets:
            return base.norm_add_norm_linear(x, x_norm, residual, norm, proj)
        owed, _ = x_norm(x)
        normed, summed = norm(owed, residual)
        return projected(proj, normed, step), summed

    def silu_mul_linear(x, proj: Linear):
        step = context.step
        if step is None or proj not in targets:
            return base.silu_mul_linear(x, proj)
        return projected(proj, torch_silu_and_mul(x), step)

    def row_parallel_linear(x, proj: Linear, tp: TensorParallel):
        step = context.step
        if step is None or proj not in targets:
            return base.row_parallel_linear(x, proj, tp)
        return sum_later(projected(proj, x, step), tp)  # A is cut by columns: the delta is a partial sum too

    def silu_mul_row_parallel_linear(x, proj: Linear, tp: TensorParallel):
        step = context.step
        if step is None or proj not in targets:
            return base.silu_mul_row_parallel_linear(x, proj, tp)
        return sum_later(projected(proj, torch_silu_and_mul(x), step), tp)

    return dataclasses.replace(
        base,
        name=f"{base.name}+lora",
        rms_norm_linear=rms_norm_linear,
        norm_add_norm_linear=norm_add_norm_linear,
        silu_mul_linear=silu_mul_linear,
        row_parallel_linear=row_parallel_linear,
        silu_mul_row_parallel_linear=silu_mul_row_parallel_linear,
    )
