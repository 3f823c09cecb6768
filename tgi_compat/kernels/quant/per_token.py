"""Dynamic per-token activation quantization: x [T, K] -> (q [T, K] fp8 e4m3 or int8, scale [T, 1] fp32).

One program per row: pass 1 finds the row's absmax, pass 2 writes round(x / scale) with
scale = absmax / QMAX (QMAX 448 for e4m3, 127 for int8), the input the FP8 `_scaled_mm` and int8
`_int_mm` GEMMs take. torch needs four launches for this (abs, amax, div, cast); at batch 1 that is
one launch per projection instead of four.

The same quantization also runs as the epilogue of RMSNorm (with its residual add) and of SiLU-and-mul
(`rmsnorm_quant_per_token`, `silu_mul_quant_per_token`): the FP8 GEMM's input comes straight out of the
kernel before it, with no launch and no half-precision round trip of its own. Both round the activation
to the model's dtype first, as the unfused kernels store it, so they give the same bits as the
unfused pair.

Rounding is done in fp32 before the store (to nearest, ties to even), so the store's conversion is
exact: the same bits on every GPU, and under Triton's CPU interpreter (whose fp8 conversion rounds
values that carry into the next exponent wrongly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.elementwise.rmsnorm import add_residual, load_weight, rms_normalize
from tgi_compat.kernels.elementwise.silu_mul import gated_activation

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros instead of NaN


@triton.jit
def _round_half_even(t):
    r = tl.floor(t + 0.5)
    is_tie = (r - t) == 0.5
    is_odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(is_tie & is_odd, r - 1.0, r)


@triton.jit
def _to_grid(v, IS_FP8: tl.constexpr):
    """v (|v| <= QMAX) rounded to the nearest value of the target format, still in fp32."""
    if IS_FP8:
        # e4m3: 3 mantissa bits; exponents below -6 are subnormal with a fixed step of 2^-9
        exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0)
        step = tl.exp2(exponent - 3.0)
        return _round_half_even(v / step) * step
    return _round_half_even(v)


@triton.jit
def _quant_per_token_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_q,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / QMAX, 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = _to_grid(tl.minimum(tl.maximum(x / scale, -QMAX), QMAX), IS_FP8)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_quantized_row(y, q_ptr, scale_ptr, row, offs, mask, stride_q, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """One whole row y (fp32) quantized with its own absmax scale."""
    y = tl.where(mask, y, 0.0)
    scale = tl.maximum(tl.max(tl.abs(y), 0) / QMAX, 1e-12)
    tl.store(scale_ptr + row, scale)
    q = _to_grid(tl.minimum(tl.maximum(y / scale, -QMAX), QMAX), IS_FP8)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr,  # [T, C]
    residual_ptr,  # [T, C] contiguous, read when HAS_RESIDUAL
    residual_out_ptr,  # [T, C] contiguous, receives x + residual when HAS_RESIDUAL
    weight_ptr,  # [C]
    q_ptr,  # [T, C]
    scale_ptr,  # [T]
    stride_x,
    stride_q,
    eps,
    NUM_COLS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_COLS
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # tgi_compat/kernels/elementwise/rmsnorm.py's helpers: its roundings, bit for bit
        x = add_residual(x, residual_ptr + row * NUM_COLS, residual_out_ptr + row * NUM_COLS, offs, mask)
    y = rms_normalize(x, load_weight(weight_ptr, offs, mask), eps, NUM_COLS)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_quantized_row(y, q_ptr, scale_ptr, row, offs, mask, stride_q, QMAX, IS_FP8)


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr,  # [T, 2 I]
    q_ptr,  # [T, I]
    scale_ptr,  # [T]
    stride_x,
    stride_q,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
    y = (
        gated_activation(gate, up, False).to(x_ptr.dtype.element_ty).to(tl.float32)
    )  # as tgi_compat/kernels/elementwise/silu_mul.py stores
    _store_quantized_row(y, q_ptr, scale_ptr, row, offs, mask, stride_q, QMAX, IS_FP8)


def _row_outputs(x: torch.Tensor, num_cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape[0], num_cols, dtype=dtype, device=x.device)
    return q, torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)


def _qmax(dtype: torch.dtype) -> tuple[float, bool]:
    is_fp8 = dtype == torch.float8_e4m3fn
    return (FP8_E4M3_MAX if is_fp8 else INT8_MAX), is_fp8


def rmsnorm_quant_per_token(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C]
    eps: float,
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,  # [T, C]: normalise x + residual
    residual_out: torch.Tensor | None = None,  # [T, C]: receives x + residual
) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_per_token(rmsnorm(x [+ residual])) in one launch: (q [T, C] in dtype, scale [T, 1] float32)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    num_cols = x.shape[1]
    q, scale = _row_outputs(x, num_cols, dtype)
    if residual is not None:
        assert residual_out is not None and residual.is_contiguous() and residual_out.is_contiguous()
    if x.shape[0] == 0:
        return q, scale
    qmax, is_fp8 = _qmax(dtype)
    block = triton.next_power_of_2(num_cols)
    _rmsnorm_quant_kernel[(x.shape[0],)](
        x,
        residual if residual is not None else x,
        residual_out if residual_out is not None else x,
        weight,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        eps,
        NUM_COLS=num_cols,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        QMAX=qmax,
        IS_FP8=is_fp8,
        num_warps=min(16, max(1, block // 256)),
    )
    return q, scale


def silu_mul_quant_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_per_token(silu(x[:, :I]) * x[:, I:]) in one launch: (q [T, I] in dtype, scale [T, 1] float32)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    intermediate = x.shape[1] // 2
    q, scale = _row_outputs(x, intermediate, dtype)
    if x.shape[0] == 0:
        return q, scale
    qmax, is_fp8 = _qmax(dtype)
    block = triton.next_power_of_2(intermediate)
    _silu_mul_quant_kernel[(x.shape[0],)](
        x,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        QMAX=qmax,
        IS_FP8=is_fp8,
        num_warps=min(16, max(1, block // 256)),
    )
    return q, scale


def quant_per_token(x: torch.Tensor, dtype: torch.dtype, block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] in dtype (float8_e4m3fn or int8), scale [T, 1] float32), x ~= q * scale."""
    assert x.dim() == 2 and x.stride(-1) == 1
    num_rows, k = x.shape
    q = torch.empty(num_rows, k, dtype=dtype, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    is_fp8 = dtype == torch.float8_e4m3fn
    _quant_per_token_kernel[(num_rows,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        QMAX=FP8_E4M3_MAX if is_fp8 else INT8_MAX,
        IS_FP8=is_fp8,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=4,
    )
    return q, scale


def quant_per_token_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = FP8_E4M3_MAX if dtype == torch.float8_e4m3fn else INT8_MAX
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=_MIN_SCALE)
    q = (xf / scale).clamp(-qmax, qmax)
    if dtype == torch.int8:
        q = q.round()
    return q.to(dtype), scale
