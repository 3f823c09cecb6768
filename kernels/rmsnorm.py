"""RMSNorm over the last dim, optionally fused with the residual add that precedes it.

With a residual the kernel computes s = x + residual (rounded to the activation dtype, as an
unfused model would store it), writes s to `residual_out` (which may be `residual` itself), and
normalizes s. That is the decoder-layer pattern: one read of x and residual, one write of each output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_row(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    weight_ptr,
    row,
    offs,  # [BLOCK] the row's columns, masked by `mask`
    mask,
    stride_x,
    stride_r,
    stride_ro,
    eps,
    NUM_COLS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row's RMSNorm times its weight (not yet rounded to the output dtype), x + residual written to
    residual_out first when HAS_RESIDUAL. The body of every kernel that normalizes a whole row
    (here; kernels/quant_activation.py's RMSNorm with per-token quantization)."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / NUM_COLS + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    # normalise in fp32, round to the activation dtype, then scale (HF's order of roundings)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty)
    return normed * w


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [N, C]
    residual_ptr,  # [N, C], read when HAS_RESIDUAL
    residual_out_ptr,  # [N, C], receives x + residual when HAS_RESIDUAL (may alias residual_ptr)
    weight_ptr,  # [C]
    out_ptr,  # [N, C]
    stride_x,
    stride_r,
    stride_ro,
    stride_o,
    eps,
    NUM_COLS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_COLS
    y = rmsnorm_row(
        x_ptr, residual_ptr, residual_out_ptr, weight_ptr, row, offs, mask, stride_x, stride_r, stride_ro, eps,
        NUM_COLS, HAS_RESIDUAL,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,  # [..., C]
    weight: torch.Tensor,  # [C]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., C]
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,  # receives x + residual; default: residual, in place
) -> torch.Tensor:
    num_cols = x.shape[-1]
    x2 = x.reshape(-1, num_cols)
    assert x2.stride(-1) == 1
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out2 = out.view(-1, num_cols)
    res2 = residual.view(-1, num_cols) if residual is not None else x2
    res_out2 = residual_out.view(-1, num_cols) if residual_out is not None else res2
    if x2.shape[0] == 0:
        return out
    block = triton.next_power_of_2(num_cols)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        res2,
        res_out2,
        weight,
        out2,
        x2.stride(0),
        res2.stride(0),
        res_out2.stride(0),
        out2.stride(0),
        eps,
        NUM_COLS=num_cols,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if residual is not None:
        residual.copy_((x.float() + residual.float()).to(residual.dtype))
        x = residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * weight).to(x.dtype)
