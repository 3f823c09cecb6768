"""Dynamic per-token activation quantization: x [T, K] -> (q [T, K] fp8 e4m3 or int8, scale [T, 1] fp32).

One program per row: pass 1 finds the row's absmax, pass 2 writes round(x / scale) with
scale = absmax / QMAX (QMAX 448 for e4m3, 127 for int8), the input the FP8 `_scaled_mm` and int8
`_int_mm` GEMMs take. torch needs four launches for this (abs, amax, div, cast); at batch 1 that is
one launch per projection instead of four.

Rounding is done in fp32 before the store (to nearest, ties to even), so the store's conversion is
exact: the same bits on every GPU, and under Triton's CPU interpreter (whose fp8 conversion rounds
values that carry into the next exponent wrongly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
