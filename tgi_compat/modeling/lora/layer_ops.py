"""The model's LayerOps with LoRA: the ops that end in a projection add each LoRA row's low-rank product.

Built once, when LoRA is enabled, around the ops chosen at startup. A step without a LoRA row (context.step
None) takes the base op unchanged. A step with one takes it too, fused norm or SiLU-and-mul prologue and all,
then adds the LoRA delta (the segmented shrink and expand): the shrink runs the same prologue on the input the
base op read (the pre-norm rows every norm op hands back as the next residual, or the [gate | up] rows), so no
activation the fused kernel keeps to itself is needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tgi_compat.kernels.lora.shrink import ShrinkPrologue
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.ops import LayerOps, sum_later
from tgi_compat.modeling.lora.step import LoraStep
from tgi_compat.modeling.lora.weights import LoraWeights
from tgi_compat.modeling.parallel import TensorParallel


@dataclass(slots=True)
class LoraContext:
    """What every layer of a LoRA-enabled model reads: the current step's segments, None in a plain step."""

    step: LoraStep | None = None


SILU_MUL = ShrinkPrologue(silu_mul=True)


def lora_layer_ops(base: LayerOps, context: LoraContext, targets: dict[Linear, LoraWeights]) -> LayerOps:
    def rms_norm_linear(x, residual, norm, proj: Linear, sum_over: TensorParallel | None = None):
        out, summed = base.rms_norm_linear(x, residual, norm, proj, sum_over)
        step = context.step
        if step is None or proj not in targets:
            return out, summed
        return targets[proj].add_to(out, summed, step, ShrinkPrologue(norm.weight, norm.eps)), summed

    def norm_add_norm_linear(x, x_norm, residual, norm, proj: Linear):
        out, summed = base.norm_add_norm_linear(x, x_norm, residual, norm, proj)
        step = context.step
        if step is None or proj not in targets:
            return out, summed
        return targets[proj].add_to(out, summed, step, ShrinkPrologue(norm.weight, norm.eps)), summed

    def silu_mul_linear(x, proj: Linear):
        step = context.step
        if step is None or proj not in targets:
            return base.silu_mul_linear(x, proj)
        return targets[proj].add_to(base.silu_mul_linear(x, proj), x, step, SILU_MUL)

    def row_parallel_linear(x, proj: Linear, tp: TensorParallel):
        step = context.step
        if step is None or proj not in targets:
            return base.row_parallel_linear(x, proj, tp)
        return sum_later(targets[proj].add_to(proj(x), x, step), tp)  # A is cut by columns: a partial sum too

    def silu_mul_row_parallel_linear(x, proj: Linear, tp: TensorParallel):
        step = context.step
        if step is None or proj not in targets:
            return base.silu_mul_row_parallel_linear(x, proj, tp)
        # the base GEMV without the all-reduce it may push: the delta joins the partial sum first
        return sum_later(silu_mul_linear(x, proj), tp)

    return dataclasses.replace(
        base,
        name=f"{base.name}+lora",
        rms_norm_linear=rms_norm_linear,
        norm_add_norm_linear=norm_add_norm_linear,
        silu_mul_linear=silu_mul_linear,
        row_parallel_linear=row_parallel_linear,
        silu_mul_row_parallel_linear=silu_mul_row_parallel_linear,
    )
