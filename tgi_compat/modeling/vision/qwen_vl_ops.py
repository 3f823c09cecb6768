"""The seams of the Qwen VL vision encoder's forward (modeling/vision/qwen2_5_vl.py), each a small typed choice made
when the encoder is built, so that one line flips it once a GPU number says so (benchmarks/device/vision_encoder.py
times every choice):

* `VisionAttention`: how every block's packed non-causal attention runs over the call's `Spans` (its windows or
  whole images): the Triton varlen kernel, torch's FlashAttention varlen, or sdpa per length group (the CPU path and
  the reference);
* `VisionElementwise`: the ops around the GEMMs: transformers' own modules (RMSNorm and rotary upcast whole
  tensors to fp32: ~10 passes over memory each), or the repo's Triton kernels doing the same fp32 math in one pass
  (the RMSNorm fused with the residual add before it, the rotary in place on the qkv output, the MLP's
  SiLU-and-mul after one [gate | up] GEMM), and the window blocks' rotary and attention as one kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from tgi_compat.kernels.attention.varlen import (
    LengthGroups,
    grouped_sdpa,
    length_groups,
    varlen_attention,
    varlen_attention_flash,
)
from tgi_compat.modeling.vision.qwen_vl_mlp import PaddedSwiGLU


@dataclass(frozen=True)
class Spans:
    """Packed sequences (an image's windows, or its whole patches): cu_seqlens on the device and on the host, the
    longest on the host, and (the sdpa path's, built at its first use in a call, for every layer that attends these
    spans) the rows per sequence length."""

    cu_seqlens: torch.Tensor
    host_cu_seqlens: torch.Tensor
    longest: int

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, device: torch.device) -> Spans:
        """From cu_seqlens on the host (no read back from the device)."""
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return cls(cu_seqlens.to(device, torch.int32, non_blocking=True), cu_seqlens, longest)

    @functools.cached_property
    def groups(self) -> LengthGroups:
        return length_groups(self.host_cu_seqlens, self.cu_seqlens.device)


AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Spans, float], torch.Tensor]  # (q, k, v, spans, scale)


@dataclass(frozen=True, slots=True)
class VisionAttention:
    """How every block's packed non-causal attention runs (q, k, v [T, H, D] over `Spans`)."""

    name: str
    attend: AttendFn
    on_cpu: bool  # False: CPU tensors take SDPA (the reference) instead


def _triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans, scale: float) -> torch.Tensor:
    return varlen_attention(q, k, v, spans.cu_seqlens, spans.longest, scale)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans, scale: float) -> torch.Tensor:
    if q.dtype not in (torch.bfloat16, torch.float16):  # FlashAttention has no fp32 kernel (fp32 serving, tests)
        return _triton(q, k, v, spans, scale)
    return varlen_attention_flash(q, k, v, spans.cu_seqlens, spans.longest, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans, scale: float) -> torch.Tensor:
    return grouped_sdpa(q, k, v, spans.groups, scale)


TRITON = VisionAttention("triton", _triton, on_cpu=False)  # kernels/attention/varlen.py: one launch a layer
FLASH = VisionAttention("flash", _flash, on_cpu=False)  # torch's FlashAttention-2 varlen, one launch a layer
SDPA = VisionAttention("sdpa", _sdpa, on_cpu=True)  # one sdpa per sequence length: the CPU path and the reference
VISION_ATTENTION = {backend.name: backend for backend in (TRITON, FLASH, SDPA)}
# issue 41: the windows' attention where the elementwise choice does not attend them itself (benchmarks/device/
# vision_encoder.py, H100, 3 images of 1024px, 28 window blocks: flash 3.42 ms, sdpa 14.74; session 38)
DEFAULT_VISION_ATTENTION = FLASH
# whole images' (Qwen2.5-VL's 4 full blocks, Qwen2-VL's every block): sdpa 6.11 ms, flash's varlen 7.02 for the 4
# full blocks of those 3 images (session 38; sdpa under cuDNN's fused attention took 6.68)
DEFAULT_FULL_ATTENTION = SDPA


# a call's rope tables, in the layout of the VisionElementwise that made them
Tables = tuple[torch.Tensor, torch.Tensor]
WindowAttend = Callable[[torch.Tensor, Tables, Spans, float], torch.Tensor]


@dataclass(frozen=True, slots=True)
class VisionElementwise:
    """The blocks' norms and rotary: transformers' math, unfused or fused."""

    name: str
    # (x, the block's norm module, residual | None) -> (norm(residual + x), residual + x)
    norm: Callable[[torch.Tensor, nn.Module, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
    tables: Callable[[torch.Tensor, torch.Tensor], Tables]  # (cos, sin [T, D]), once a call -> the rotary's tables
    rotary: Callable[[torch.Tensor, torch.Tensor, Tables], tuple[torch.Tensor, torch.Tensor]]  # (q, k) -> rotated
    mlp: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (the block's MLP, x) -> its output
    on_cpu: bool  # False: CPU tensors take TRANSFORMERS instead
    rms_norm_only: bool  # True: a tower of LayerNorms (Qwen2-VL's) takes TRANSFORMERS instead
    # (qkv [T, 3, H, D], tables, spans of up to WINDOW_TOKENS, scale) -> [T, H, D]: q and k roped as they are read
    # and every span attended, in place of `rotary` and the attention backend; None: those two always
    windows: WindowAttend | None = None


def _module_norm(x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if residual is None else residual + x  # the block's `hidden_states + sublayer(...)`
    return norm(summed), summed


def _vision_rotary(q: torch.Tensor, k: torch.Tensor, tables: Tables) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision  # Qwen2.5-VL's copy

    return apply_rotary_pos_emb_vision(q, k, *tables)


def _triton_norm(x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    from tgi_compat.modeling.layers.triton_ops import triton_rms_norm

    assert isinstance(norm, Qwen2_5_VLRMSNorm)  # rms_norm_only: the encoder gives this op RMSNorm towers alone
    normed, summed = triton_rms_norm(x, norm.weight, norm.variance_epsilon, residual)
    return normed, x if summed is None else summed


def _module_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp(x)


def _fused_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from tgi_compat.kernels.elementwise.silu_mul import silu_mul

    assert isinstance(mlp, PaddedSwiGLU)  # rms_norm_only: Qwen2.5-VL's towers alone, whose MLPs the encoder swaps
    return mlp.fused(x, silu_mul)  # one rounding of silu(gate) * up where transformers' rounds each


def _half_tables(cos: torch.Tensor, sin: torch.Tensor) -> Tables:
    half = cos.shape[-1] // 2  # the vision rope repeats its angles over both halves: the kernel reads one
    return cos[:, :half].contiguous(), sin[:, :half].contiguous()


def _triton_rotary(q: torch.Tensor, k: torch.Tensor, tables: Tables) -> tuple[torch.Tensor, torch.Tensor]:
    from tgi_compat.kernels.attention.rotary import rotary_embedding

    rotary_embedding(q, k, *tables)  # in place, on the qkv output's views: fp32 math, one rounding
    return q, k


def _triton_windows(qkv: torch.Tensor, tables: Tables, spans: Spans, scale: float) -> torch.Tensor:
    from tgi_compat.kernels.attention.window import window_attention

    return window_attention(qkv, spans.cu_seqlens, spans.longest, scale, *tables)


TRANSFORMERS = VisionElementwise(
    "transformers", _module_norm, lambda cos, sin: (cos, sin), _vision_rotary, _module_mlp, True, False
)
TRITON_ELEMENTWISE = VisionElementwise(
    "triton", _triton_norm, _half_tables, _triton_rotary, _fused_mlp, False, True, windows=_triton_windows
)
# the same with the windows roped in place and then attended by the backend (the comparison the benchmark times)
TRITON_SEPARATE_WINDOWS = dataclasses.replace(TRITON_ELEMENTWISE, name="triton-separate-windows", windows=None)
VISION_ELEMENTWISE = {ops.name: ops for ops in (TRANSFORMERS, TRITON_ELEMENTWISE, TRITON_SEPARATE_WINDOWS)}
# issue 41: the fused kernels; transformers' modules cost 15.5 ms more per 1024px image (45.5 vs 30.0 ms, H100)
DEFAULT_VISION_ELEMENTWISE = TRITON_ELEMENTWISE
