"""Gated activations over a fused [gate | up] projection output: SwiGLU silu(gate) * up, and GeGLU
gelu_tanh(gate) * up (Gemma) through the same kernel's GELU_TANH switch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gated_activation(gate, up, GELU_TANH: tl.constexpr):
    """silu(gate) * up, or gelu_tanh(gate) * up, in fp32 from fp32 operands (not yet rounded): the body of
    every kernel with a gated activation (here, tgi_compat/kernels/quant/per_token.py, tgi_compat/kernels/gemv/prologue.py)."""
    if GELU_TANH:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        out = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    return out


@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [N, 2 * I]
    out_ptr,  # [N, I]
    stride_x,
    stride_o,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
    out = gated_activation(gate, up, GELU_TANH)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, gelu_tanh: bool = False) -> torch.Tensor:
    """x: [..., 2 * I] -> [..., I]; with gelu_tanh, GeGLU (tanh-approximated GELU) instead of SwiGLU."""
    intermediate = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    assert x2.stride(-1) == 1
    if out is None:
        out = torch.empty(*x.shape[:-1], intermediate, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, intermediate)
    if x2.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate))
    grid = (x2.shape[0], triton.cdiv(intermediate, block))
    _silu_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), INTERMEDIATE=intermediate, BLOCK=block, GELU_TANH=gelu_tanh, num_warps=4
    )
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)
