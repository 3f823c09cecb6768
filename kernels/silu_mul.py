"""SwiGLU activation: silu(gate) * up over a fused [gate | up] projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [N, 2 * I]
    out_ptr,  # [N, I]
    stride_x,
    stride_o,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * I] -> [..., I]."""
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
    _silu_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), INTERMEDIATE=intermediate, BLOCK=block, num_warps=4)
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
