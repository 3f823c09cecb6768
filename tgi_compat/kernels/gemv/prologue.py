"""The GEMV's fused prologue over [rows, K block] tiles of x, in fp32 with the unfused kernels' roundings: f(x) = x,
RMSNorm with the residual add (before the 1/rms scale), the gated activations, or NORM_ADD_NORM's
rmsnorm(residual + rmsnorm(x, w1)); and the passes one program makes for x + residual.

The activations' operands travel as one tuple, `x_rows` = (x_ptr, residual_ptr, norm_weight_ptr, x_norm_weight_ptr,
x_inv_rms, rows_m, mask_m, stride_xm, K): a kernel builds it once and its K loop hands it on whole (Triton flattens
tuples and inlines the helpers, so the generated code is that of separate arguments).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tgi_compat.kernels.elementwise import rmsnorm as rmsnorm_module
from tgi_compat.kernels.elementwise.silu_mul import gated_activation


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def activation_block(x_rows, offs_k, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """(f(x)[rows, offs_k] in fp32 (before the 1/rms scale), [BLOCK_M, len(offs_k)]; its squares for the RMS)."""
    x_ptr, residual_ptr, norm_weight_ptr, x_norm_weight_ptr, x_inv_rms, rows_m, mask_m, stride_xm, K = x_rows
    mask_k = offs_k < K
    mask = mask_m[:, None] & mask_k[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1 or PROLOGUE == 4:
        h = _load(x_ptrs, mask, EVEN_K)
        if PROLOGUE == 4:
            h = _x_normed(h, x_inv_rms, _load(x_norm_weight_ptr + offs_k, mask_k, EVEN_K))
        if HAS_RESIDUAL:  # rounded to x's dtype, as an unfused residual add would store it
            r_offs = rows_m[:, None] * K + offs_k[None, :]
            h = (h.to(tl.float32) + _load(residual_ptr + r_offs, mask, EVEN_K).to(tl.float32)).to(dtype)
        hf = h.to(tl.float32)
        xk = hf * _load(norm_weight_ptr + offs_k, mask_k, EVEN_K).to(tl.float32)[None, :]
        squares = hf * hf
    elif PROLOGUE == 2 or PROLOGUE == 3:  # rounded to x's dtype as tgi_compat/kernels/elementwise/silu_mul.py stores it
        gate = _load(x_ptrs, mask, EVEN_K).to(tl.float32)
        up = _load(x_ptrs + K, mask, EVEN_K).to(tl.float32)
        xk = gated_activation(gate, up, PROLOGUE == 3).to(dtype).to(tl.float32)
        squares = xk  # unused
    else:
        xk = _load(x_ptrs, mask, EVEN_K).to(tl.float32)
        squares = xk  # unused
    return xk, squares


@triton.jit
def _x_normed(x, x_inv_rms, x_norm_weight):
    """rmsnorm(x) * w1 of a [rows, K block] tile given x's 1/rms per row, with tgi_compat/kernels/elementwise/rmsnorm.py's
    roundings: normalised in fp32, rounded to x's dtype, scaled, rounded again (the unfused norm's stored output)."""
    normed = (x.to(tl.float32) * x_inv_rms[:, None]).to(x.dtype)
    weight = x_norm_weight.to(tl.float32)[None, :]
    return rmsnorm_module.mul_uncontracted(normed.to(tl.float32), weight).to(x.dtype)  # not fused into the add


@triton.jit
def inv_rms_rows(x_ptr, rows_m, mask_m, stride_xm, K, eps, X_BLOCK: tl.constexpr):
    """1/rms of each row of x [rows, K] (NORM_ADD_NORM's first norm), read X_BLOCK features at a time: the
    whole row at once when it fits, so that it costs one L2 round trip before the main loop, not one a slice."""
    sum_sq = tl.zeros_like(rows_m).to(tl.float32)
    for k0 in range(0, K, X_BLOCK):
        offs_k = k0 + tl.arange(0, X_BLOCK)
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        xf = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(xf * xf, 1)
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def store_normed_residual_sum(
    x_ptr, x_norm_weight_ptr, x_inv_rms, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K
):
    """NORM_ADD_NORM's residual_out = residual + rmsnorm(x, w1), as `activation_block` computes it."""
    for k0 in range(0, K, 256):
        offs_k = k0 + tl.arange(0, 256)
        mask_k = offs_k < K
        mask = mask_m[:, None] & mask_k[None, :]
        r_offs = rows_m[:, None] * K + offs_k[None, :]
        h = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        h = _x_normed(h, x_inv_rms, tl.load(x_norm_weight_ptr + offs_k, mask=mask_k, other=0.0))
        h = h.to(tl.float32) + tl.load(residual_ptr + r_offs, mask=mask).to(tl.float32)
        tl.store(residual_out_ptr + r_offs, h.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_residual_sum(x_ptr, residual_ptr, residual_out_ptr, rows_m, mask_m, stride_xm, K):
    """residual_out = x + residual rounded to x's dtype, as the prologue computes it (one program writes it,
    in a pass of its own: a store inside the main loop would keep later weight loads from being hoisted)."""
    for k0 in range(0, K, 256):  # small tiles: this pass must not raise the kernel's register count
        offs_k = k0 + tl.arange(0, 256)
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        r_offs = rows_m[:, None] * K + offs_k[None, :]
        h = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=mask).to(tl.float32)
        h += tl.load(residual_ptr + r_offs, mask=mask).to(tl.float32)
        tl.store(residual_out_ptr + r_offs, h.to(x_ptr.dtype.element_ty), mask=mask)
