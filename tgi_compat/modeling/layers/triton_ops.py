"""LayerOps backed by the Triton kernels in tgi_compat/kernels/ (selected by `select_ops` on CUDA).

Same contract as TORCH_OPS in ops.py. Rotary rotates in place and returns its input (the
[T, H + H_kv, D] q|k view of the fused qkv output, so q and k turn in one launch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tgi_compat.kernels.attention.rotary import rotary_embedding
from tgi_compat.kernels.elementwise.rmsnorm import norm_add_rmsnorm, qk_rmsnorm, rmsnorm
from tgi_compat.kernels.elementwise.silu_mul import silu_mul
from tgi_compat.kernels.gemv.config import gemv_config_for
from tgi_compat.kernels.gemv.gemv import gemv
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_GELU_TANH_MUL,
    PROLOGUE_NONE,
    PROLOGUE_NORM_ADD_NORM,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
)
from tgi_compat.kernels.quant.per_token import rmsnorm_quant_per_token, silu_mul_quant_per_token
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.ops import (
    LayerOps,
    RopeLayout,
    sum_later,
    sum_now,
    unfused_rms_norm_linear,
    unfused_silu_mul_linear,
)
from tgi_compat.modeling.layers.weight_prefetch import weight_prefetched_beside

if TYPE_CHECKING:
    from tgi_compat.kernels.gemv.types import GemvConfig, QuantizedWeight
    from tgi_compat.modeling.layers.norm import RMSNorm
    from tgi_compat.modeling.parallel import TensorParallel


def triton_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is None:
        return rmsnorm(x, weight, eps), None
    summed = torch.empty_like(residual)  # a fresh tensor: the caller's residual may still be referenced
    return rmsnorm(x, weight, eps, residual=residual, residual_out=summed), summed


def triton_rope_tables(
    cos_half: torch.Tensor, sin_half: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # [T, D/2] each: gathered once per step, read by every layer's rotary launch
    return cos_half[positions], sin_half[positions]


def triton_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = tables
    rotary_embedding(x, None, cos, sin)
    return x


def triton_qk_norm(qk: torch.Tensor, num_q_heads: int, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
    """Both norms in one launch, in place on the q|k view (no copies, no concatenation)."""
    assert q_norm.eps == k_norm.eps
    return qk_rmsnorm(qk, q_norm.weight, k_norm.weight, q_norm.eps, num_q_heads)


def triton_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: RMSNorm,
    proj: Linear,
    sum_over: TensorParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Few decode rows (one for a plain weight, up to 8 for a quantized one): the norm runs inside the
    GEMV's prologue; an FP8 GEMM gets its per-token FP8 input from the norm kernel; else rmsnorm kernel +
    matmul. With `sum_over`, the sum over the ranks, the residual add and the norm are one kernel where the
    one-trip all-reduce takes them (tgi_compat.kernels.comm.one_shot_all_reduce), else the sum comes first; the projection's weight
    travels to L2 meanwhile (weight_prefetch)."""
    weight = proj.gemv_weight  # None: the projection's method has no GEMV, it runs the matmul itself
    if sum_over is not None:
        with weight_prefetched_beside(weight if isinstance(weight, torch.Tensor) else None, x.shape[0]):
            fused = sum_over.all_reduce_rms_norm(x, residual, norm) if residual is not None else None
            if fused is None:
                x = sum_now(x, sum_over)
        if fused is not None:
            normed, stream = fused
            return proj(normed), stream
    config = gemv_config_for(x, weight, PROLOGUE_RMSNORM) if weight is not None else None
    if config is None:
        if not proj.takes_fp8_activations:
            return unfused_rms_norm_linear(x, residual, norm, proj)
        summed = torch.empty_like(x) if residual is not None else None
        x_q, x_scale = rmsnorm_quant_per_token(
            x, norm.weight, norm.eps, torch.float8_e4m3fn, residual=residual, residual_out=summed
        )
        return proj.forward_fp8(x_q, x_scale, x.dtype), (x if summed is None else summed)
    assert weight is not None  # a config implies a GEMV weight
    summed = torch.empty_like(x) if residual is not None else None
    out = _norm_prologue_gemv(x, weight, proj, norm, residual, summed, config)
    return out, (x if summed is None else summed)


def _norm_prologue_gemv(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    proj: Linear,
    norm: RMSNorm,
    residual: torch.Tensor | None,
    summed: torch.Tensor | None,
    config: GemvConfig,
    x_norm: RMSNorm | None = None,
) -> torch.Tensor:
    """proj(norm(x_norm(x) + residual)) as one GEMV, the norms and the add in its prologue (x_norm: none
    without one); `summed` receives the sum."""
    return gemv(
        x,
        weight,
        proj.bias,
        norm_weight=norm.weight,
        eps=norm.eps,
        residual=residual,
        residual_out=summed,
        x_norm_weight=None if x_norm is None else x_norm.weight,
        x_eps=0.0 if x_norm is None else x_norm.eps,
        config=config,
    )


def triton_norm_add_norm_linear(
    x: torch.Tensor, x_norm: RMSNorm, residual: torch.Tensor, norm: RMSNorm, proj: Linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """At a decode row all three ops run in the projection's GEMV prologue (no launch of their own); else one
    norm-add-norm kernel, then the projection."""
    weight = proj.gemv_weight
    config = gemv_config_for(x, weight, PROLOGUE_NORM_ADD_NORM) if weight is not None else None
    summed = torch.empty_like(residual)  # a fresh tensor: the caller's residual may still be referenced
    if config is None:
        normed = norm_add_rmsnorm(x, x_norm.weight, x_norm.eps, residual, norm.weight, norm.eps, residual_out=summed)
        return proj(normed), summed
    assert weight is not None  # a config implies a GEMV weight
    return _norm_prologue_gemv(x, weight, proj, norm, residual, summed, config, x_norm), summed


def triton_silu_mul_linear(x: torch.Tensor, proj: Linear) -> torch.Tensor:
    weight = proj.gemv_weight
    config = gemv_config_for(x, weight, PROLOGUE_SILU_MUL) if weight is not None else None
    if config is None:
        if not proj.takes_fp8_activations:
            return unfused_silu_mul_linear(x, proj, silu_mul)
        x_q, x_scale = silu_mul_quant_per_token(x, torch.float8_e4m3fn)
        return proj.forward_fp8(x_q, x_scale, x.dtype)
    assert weight is not None  # a config implies a GEMV weight
    return gemv(x, weight, proj.bias, silu_mul=True, config=config)


def triton_gelu_tanh_mul_linear(x: torch.Tensor, proj: Linear) -> torch.Tensor:
    """Gemma's GeGLU then its down projection: one GEMV at a decode row, else the gated kernel + matmul."""
    weight = proj.gemv_weight
    config = gemv_config_for(x, weight, PROLOGUE_GELU_TANH_MUL) if weight is not None else None
    if weight is None or config is None:
        return proj(silu_mul(x, gelu_tanh=True))
    return gemv(x, weight, proj.bias, silu_mul=True, gelu_tanh=True, config=config)


def _pushed_gemv_all_reduce(x: torch.Tensor, proj: Linear, tp: TensorParallel, prologue: int) -> torch.Tensor | None:
    """A plain weight's GEMV that sends its rows of the sum to the other ranks as it stores them
    (tgi_compat.kernels.comm.one_shot_all_reduce), then the all-reduce that only gathers; None where the GEMV or the
    push does not apply (the caller runs the projection, then `tp.all_reduce`)."""
    weight = proj.gemv_weight
    if not isinstance(weight, torch.Tensor):  # quantized methods pick their own kernels at few rows
        return None
    config = gemv_config_for(x, weight, prologue)
    push = tp.push_target(x.shape[0] * weight.shape[0], x.dtype) if config is not None else None
    if push is None:
        return None
    out = gemv(x, weight, proj.bias, silu_mul=prologue == PROLOGUE_SILU_MUL, config=config, push=push)
    return tp.finish_pushed_all_reduce(out)


def triton_row_parallel_linear(
    x: torch.Tensor, proj: Linear, tp: TensorParallel
) -> tuple[torch.Tensor, TensorParallel | None]:
    """At a decode row the GEMV sends its sum and it is taken here; else the norm after it takes it."""
    out = _pushed_gemv_all_reduce(x, proj, tp, PROLOGUE_NONE)
    return (out, None) if out is not None else sum_later(proj(x), tp)


def triton_silu_mul_row_parallel_linear(
    x: torch.Tensor, proj: Linear, tp: TensorParallel
) -> tuple[torch.Tensor, TensorParallel | None]:
    out = _pushed_gemv_all_reduce(x, proj, tp, PROLOGUE_SILU_MUL)
    return (out, None) if out is not None else sum_later(triton_silu_mul_linear(x, proj), tp)


TRITON_OPS = LayerOps(
    name="triton",
    rms_norm=triton_rms_norm,
    rope_tables=triton_rope_tables,
    rope_layout=RopeLayout.HALF,
    rotary=triton_rotary,
    qk_norm=triton_qk_norm,
    rms_norm_linear=triton_rms_norm_linear,
    norm_add_norm_linear=triton_norm_add_norm_linear,
    silu_mul_linear=triton_silu_mul_linear,
    row_parallel_linear=triton_row_parallel_linear,
    silu_mul_row_parallel_linear=triton_silu_mul_row_parallel_linear,
)
