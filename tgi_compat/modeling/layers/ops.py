"""The elementwise layer ops, behind one object chosen once at startup.

Layers never call torch or Triton for these directly: they call `self.ops.<op>`, so the GPU path
can swap in the kernels in tgi_compat/kernels/ (rmsnorm, rotary, silu_mul, gemv) without touching any model file.
`TORCH_OPS` is the reference, used on CPU and in tests; `select_ops(device)` picks at startup.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from tgi_compat.modeling.parallel import TensorParallel

logger = logging.getLogger(__name__)

RopeTables = tuple[torch.Tensor, ...]  # a step's rope rows, in the layout of the LayerOps that built them


class RopeLayout(Enum):
    """How an op set's `rope_tables` lays out a step's rope rows (what its `rotary` and an attention backend's fused
    rotary may read)."""

    SIGNED = "signed"  # torch_rope_tables: cos over both halves and the signed sin, [T, 1, D] each
    HALF = "half"  # the Triton kernels': cos and sin of each pair, [T, D/2] each


@dataclass(frozen=True)
class LayerOps:
    name: str
    # (x [T, ..., D], weight [D], eps, residual | None) -> (normed, x + residual | None)
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    # (cos_half [P, D/2], sin_half [P, D/2], positions [T]) -> step tables, built once per step
    rope_tables: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_layout: RopeLayout  # the layout of rope_tables' output (wrapping op sets, LoRA's, keep their base's)
    # (x [T, N, D], step tables) -> x rotated (neox layout: halves rotate as pairs)
    rotary: Callable[..., torch.Tensor]
    # Qwen3 / Gemma 3's per-head norms: (qk [T, Hq + Hkv, D], Hq, q_norm: RMSNorm, k_norm: RMSNorm) -> qk with
    # the q heads normed by q_norm and the k heads by k_norm (a new tensor, or qk normed in place)
    qk_norm: Callable[..., torch.Tensor]
    # A norm and the projection after it, as one op so that a backend can fuse them:
    # (x, residual | None, norm: RMSNorm, proj: Linear, sum_over: TensorParallel | None = None) ->
    # (proj(norm(x + residual)), x + residual), with no residual (proj(norm(x)), x): the second output is the next
    # residual either way. With `sum_over`, x is this rank's part of a row-parallel projection's output, summed over
    # those ranks first (a backend may sum, add and norm in one kernel).
    rms_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # Gemma 2/3's sandwich norms: the sublayer output's own norm, the residual add, the next norm and its
    # projection: (x, x_norm: RMSNorm, residual, norm: RMSNorm, proj: Linear) ->
    # (proj(norm(residual + x_norm(x))), residual + x_norm(x))
    norm_add_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (x [T, 2 * I], proj: Linear) -> proj(silu(x[:, :I]) * x[:, I:])
    silu_mul_linear: Callable[..., torch.Tensor]
    # A row-parallel projection, whose output the ranks sum: (x, proj: Linear, tp: TensorParallel) -> (the sum,
    # None), or (this rank's part, tp) where the norm after it takes the sum (`rms_norm_linear`'s sum_over). One op,
    # so that a backend can send each rank's part from the projection's own kernel, or leave the sum to the norm's.
    row_parallel_linear: Callable[..., tuple[torch.Tensor, TensorParallel | None]]
    # The same after SiLU-and-mul: (x [T, 2 * I], proj, tp) -> silu_mul_linear(x, proj) summed, or this rank's part
    silu_mul_row_parallel_linear: Callable[..., tuple[torch.Tensor, TensorParallel | None]]


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps), residual
    # Half precision: normalise in fp32, round, then scale, in transformers' order (bit-parity).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def torch_rope_tables(
    cos_half: torch.Tensor, sin_half: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # [T, 1, D]: cos repeated over both halves, sin signed so that
    # rotate(x) = x * cos + swap_halves(x) * signed_sin  with signed_sin = [-sin, sin].
    cos = cos_half[positions]
    sin = sin_half[positions]
    return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


def torch_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, signed_sin = tables
    num_tokens, num_heads, head_dim = x.shape
    swapped = x.view(num_tokens, num_heads, 2, head_dim // 2).flip(2).view(num_tokens, num_heads, head_dim)
    return x * cos + swapped * signed_sin


def torch_qk_norm(qk: torch.Tensor, num_q_heads: int, q_norm: nn.Module, k_norm: nn.Module) -> torch.Tensor:
    q, _ = q_norm(qk[:, :num_q_heads])
    k, _ = k_norm(qk[:, num_q_heads:])
    return torch.cat((q, k), dim=1)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def unfused_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: nn.Module,
    proj: nn.Module,
    sum_over: TensorParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = sum_now(x, sum_over)
    normed, summed = norm(x, residual)  # the norm module calls its own ops' rms_norm
    return proj(normed), (x if residual is None else summed)


def unfused_norm_add_norm_linear(
    x: torch.Tensor, x_norm: nn.Module, residual: torch.Tensor, norm: nn.Module, proj: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, _ = x_norm(x)
    return unfused_rms_norm_linear(normed, residual, norm, proj)


def unfused_silu_mul_linear(x: torch.Tensor, proj: nn.Module, silu_and_mul=torch_silu_and_mul) -> torch.Tensor:
    return proj(silu_and_mul(x))


def sum_now(x: torch.Tensor, sum_over: TensorParallel | None) -> torch.Tensor:
    """x summed over the ranks it is still owed to (`sum_over`), or x as it is where it is whole."""
    return x if sum_over is None else sum_over.all_reduce(x)


def sum_later(part: torch.Tensor, tp: TensorParallel) -> tuple[torch.Tensor, TensorParallel | None]:
    """A row-parallel output left for the norm after it to sum (nothing to sum on one rank)."""
    return part, (tp if tp.is_sharded else None)


def unfused_row_parallel_linear(
    x: torch.Tensor, proj: nn.Module, tp: TensorParallel
) -> tuple[torch.Tensor, TensorParallel | None]:
    return sum_later(proj(x), tp)


def unfused_silu_mul_row_parallel_linear(
    x: torch.Tensor, proj: nn.Module, tp: TensorParallel
) -> tuple[torch.Tensor, TensorParallel | None]:
    return sum_later(unfused_silu_mul_linear(x, proj), tp)


TORCH_OPS = LayerOps(
    name="torch",
    rms_norm=torch_rms_norm,
    rope_tables=torch_rope_tables,
    rope_layout=RopeLayout.SIGNED,
    rotary=torch_rotary,
    qk_norm=torch_qk_norm,
    rms_norm_linear=unfused_rms_norm_linear,
    norm_add_norm_linear=unfused_norm_add_norm_linear,
    silu_mul_linear=unfused_silu_mul_linear,
    row_parallel_linear=unfused_row_parallel_linear,
    silu_mul_row_parallel_linear=unfused_silu_mul_row_parallel_linear,
)


def select_ops(device: torch.device) -> LayerOps:
    """Triton kernels on CUDA when tgi_compat/kernels/ provides them, else the torch reference."""
    if device.type != "cuda":
        return TORCH_OPS
    try:
        from tgi_compat.modeling.layers.triton_ops import TRITON_OPS
    except ImportError as exc:  # kernels not built yet: the torch ops run on CUDA too
        logger.warning("Triton layer ops unavailable (%s); using torch ops", exc)
        return TORCH_OPS
    return TRITON_OPS
