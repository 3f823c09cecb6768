"""The model's LayerOps with LoRA: the ops that end in a projection add each LoRA row's low-rank product.

Built once, when LoRA is enabled, around the ops chosen at startup. A step without a LoRA row (context.step
None) takes the base op unchanged. A decode-sized step with one runs a plain base's op on its widened twin (every
slot's A under the weight: folding.py), fused norm or SiLU-and-mul prologue and all, then the expand of its output. A
quantized base, or a prefill-sized step, takes the base op, then adds the LoRA delta by the segmented shrink and
expand: the shrink runs the same prologue on the input the base op read (the pre-norm rows every norm op hands back
as the next residual, or the [gate | up] rows), so no activation the fused kernel keeps to itself is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    def lora_of(proj: Linear) -> tuple[LoraWeights, LoraStep] | None:
        step = context.step
        return None if step is None or proj not in targets else (targets[proj], step)

    def norm_then_linear(op: Callable[[Linear], tuple[torch.Tensor, torch.Tensor]], rows: int, norm, proj: Linear):
        """`op(projection)` -> (out, summed): a norm op ending in `proj`, run on its widened twin or with the
        segmented delta added (whose shrink repeats the norm on `summed`, the pre-norm rows)."""
        found = lora_of(proj)
        if found is None:
            return op(proj)
        lora, step = found
        folded = lora.folded_for(rows)
        if folded is not None:
            full, summed = op(folded)
            return lora.expand_folded(full, step), summed
        out, summed = op(proj)
        return lora.add_to(out, summed, step, ShrinkPrologue(norm.weight, norm.eps)), summed

    def rms_norm_linear(x, residual, norm, proj: Linear, sum_over: TensorParallel | None = None):
        return norm_then_linear(lambda p: base.rms_norm_linear(x, residual, norm, p, sum_over), x.shape[0], norm, proj)

    def norm_add_norm_linear(x, x_norm, residual, norm, proj: Linear):
        return norm_then_linear(
            lambda p: base.norm_add_norm_linear(x, x_norm, residual, norm, p), x.shape[0], norm, proj
        )

    def silu_mul_linear(x, proj: Linear):
        found = lora_of(proj)
        if found is None:
            return base.silu_mul_linear(x, proj)
        lora, step = found
        folded = lora.folded_for(x.shape[0])
        if folded is not None:
            return lora.expand_folded(base.silu_mul_linear(x, folded), step)
        return lora.add_to(base.silu_mul_linear(x, proj), x, step, SILU_MUL)

    def row_parallel_linear(x, proj: Linear, tp: TensorParallel):
        found = lora_of(proj)
        if found is None:
            return base.row_parallel_linear(x, proj, tp)
        lora, step = found
        # A is cut by columns: the shrunk rows, and so the delta, are partial sums too
        folded = lora.folded_for(x.shape[0])
        if folded is not None:
            return sum_later(lora.expand_folded(folded(x), step), tp)
        return sum_later(lora.add_to(proj(x), x, step), tp)

    def silu_mul_row_parallel_linear(x, proj: Linear, tp: TensorParallel):
        if lora_of(proj) is None:
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
