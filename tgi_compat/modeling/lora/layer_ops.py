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
from collections.abc import Collection
from dataclasses import dataclass

import torch

from tgi_compat.kernels.elementwise.rmsnorm import rmsnorm
from tgi_compat.kernels.gemv.config import gemv_config_for
from tgi_compat.kernels.gemv.types import PROLOGUE_RMSNORM
from tgi_compat.kernels.lora.row_delta import RowDelta
from tgi_compat.kernels.lora.shrink import ShrinkPrologue
from tgi_compat.kernels.quant.per_token import rmsnorm_quant_per_token
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.norm import RMSNorm
from tgi_compat.modeling.layers.ops import LayerOps, sum_later
from tgi_compat.modeling.lora.step import LoraStep
from tgi_compat.modeling.lora.weights import LoraWeights
from tgi_compat.modeling.parallel import TensorParallel

# The folded o and down projections leave their LoRA term to the norm kernel after them (row_delta.py) where that
# norm is a wrapped rms_norm_linear that runs its own kernel (not a GEMV's prologue); tests turn it off to compare.
DEFER_TO_NORM = True


@dataclass(frozen=True, slots=True)
class PendingDelta:
    """A folded projection's output whose LoRA term is still to add: `x` (its base columns, what the projection
    returned) is owed `delta`; `lora.expand_folded` adds it where the next op cannot."""

    x: torch.Tensor
    delta: RowDelta
    lora: LoraWeights
    step: LoraStep

    def expanded(self) -> torch.Tensor:
        return self.lora.expand_folded(self.delta.full, self.step)


@dataclass(slots=True)
class LoraContext:
    """What every layer of a LoRA-enabled model reads: the current step's segments, None in a plain step; and the
    LoRA term a projection left to the norm after it (None between such pairs)."""

    step: LoraStep | None = None
    pending: PendingDelta | None = None


SILU_MUL = ShrinkPrologue(silu_mul=True)


def lora_layer_ops(
    base: LayerOps,
    context: LoraContext,
    targets: dict[Linear, LoraWeights],
    defer_to_norm: Collection[Linear] = (),
) -> LayerOps:
    """`defer_to_norm`: the row-parallel projections whose output the model passes straight to rms_norm_linear (o
    and down of a Llama-style layer, but the last layer's down): these may leave their LoRA term to it."""

    def lora_of(proj: Linear) -> tuple[LoraWeights, LoraStep] | None:
        step = context.step
        return None if step is None or proj not in targets else (targets[proj], step)

    def deferred(full: torch.Tensor, proj: Linear, lora: LoraWeights, step: LoraStep, tp: TensorParallel):
        """A folded o / down output: its LoRA term left to the norm after it where it may be, else expanded now."""
        if not (DEFER_TO_NORM and proj in defer_to_norm and not tp.is_sharded):
            return sum_later(lora.expand_folded(full, step), tp)
        x = full[:, : proj.out_features]
        context.pending = PendingDelta(x, RowDelta(full, step.token_slots, lora.b), lora, step)
        return x, None

    def owed_term(x: torch.Tensor) -> PendingDelta | None:
        pending, context.pending = context.pending, None
        assert pending is None or x is pending.x, "a LoRA term left for the norm reached another op"
        return pending

    def whole(x: torch.Tensor) -> torch.Tensor:
        """x with any LoRA term still owed to it added (an op that does not take it in its kernel)."""
        pending = owed_term(x)
        return x if pending is None else pending.expanded()

    def rms_norm_linear(x, residual, norm, proj: Linear, sum_over: TensorParallel | None = None):
        found = lora_of(proj)
        folded = None if found is None else found[0].folded_for(x.shape[0])
        pending = owed_term(x)
        if pending is not None:
            fused = _norm_with_delta(x, residual, norm, pending.delta, proj if folded is None else folded, sum_over)
            if fused is None:
                x = pending.expanded()
            elif found is None or folded is None:
                return fused
            else:
                return found[0].expand_folded(fused[0], found[1]), fused[1]
        if found is None:
            return base.rms_norm_linear(x, residual, norm, proj, sum_over)
        lora, step = found
        if folded is not None:
            full, summed = base.rms_norm_linear(x, residual, norm, folded, sum_over)
            return lora.expand_folded(full, step), summed
        out, summed = base.rms_norm_linear(x, residual, norm, proj, sum_over)
        return lora.add_to(out, summed, step, ShrinkPrologue(norm.weight, norm.eps)), summed

    def norm_add_norm_linear(x, x_norm, residual, norm, proj: Linear):
        x = whole(x)
        found = lora_of(proj)
        if found is None:
            return base.norm_add_norm_linear(x, x_norm, residual, norm, proj)
        lora, step = found
        folded = lora.folded_for(x.shape[0])
        if folded is not None:
            full, summed = base.norm_add_norm_linear(x, x_norm, residual, norm, folded)
            return lora.expand_folded(full, step), summed
        out, summed = base.norm_add_norm_linear(x, x_norm, residual, norm, proj)
        return lora.add_to(out, summed, step, ShrinkPrologue(norm.weight, norm.eps)), summed

    def silu_mul_linear(x, proj: Linear):
        x = whole(x)
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
            return deferred(folded(x), proj, lora, step, tp)
        return sum_later(lora.add_to(proj(x), x, step), tp)

    def silu_mul_row_parallel_linear(x, proj: Linear, tp: TensorParallel):
        found = lora_of(proj)
        if found is None:
            return base.silu_mul_row_parallel_linear(x, proj, tp)
        lora, step = found
        folded = lora.folded_for(x.shape[0])
        if folded is not None:
            return deferred(base.silu_mul_linear(x, folded), proj, lora, step, tp)
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


def _norm_with_delta(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: RMSNorm,
    delta: RowDelta,
    proj: Linear,
    sum_over: TensorParallel | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(proj(norm(x + delta + residual)), x + delta + residual) with the LoRA term added in the norm's own kernel,
    where the Triton ops run a norm kernel and then the projection (tgi_compat/modeling/layers/triton_ops.py: not a
    GEMV with the norm in its prologue, nor a sum over ranks); None elsewhere (the caller expands instead)."""
    if residual is None or sum_over is not None or not x.is_cuda:
        return None
    weight = proj.gemv_weight
    if weight is not None and gemv_config_for(x, weight, PROLOGUE_RMSNORM) is not None:
        return None
    summed = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    if proj.takes_fp8_activations:
        x_q, x_scale = rmsnorm_quant_per_token(
            x, norm.weight, norm.eps, torch.float8_e4m3fn, residual=residual, residual_out=summed, row_delta=delta
        )
        return proj.forward_fp8(x_q, x_scale, x.dtype), summed
    return proj(rmsnorm(x, norm.weight, norm.eps, residual=residual, residual_out=summed, row_delta=delta)), summed
