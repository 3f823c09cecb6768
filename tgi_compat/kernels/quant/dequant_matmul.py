"""Weight-only quantized matmul: y = x @ dequant(W)^T, W int8 per output channel or int4 per group.

    BITS=8  W int8 [N, K],                                  w[n, k] = W[n, k] * scale[n]
    BITS=4  W int32 [N, K/8] (eight nibbles, interleaved),  w[n, k] = (q[n, k] - zero[n, k/G]) * scale[n, k/G]

The int4 layout is tgi_compat/kernels/quant/int4_layout.py's (periods of up to 128 features, interleaved).

One program per [BLOCK_M, BLOCK_N] output tile walks K, dequantizes a [BLOCK_N, BLOCK_K] weight
tile in registers to x's dtype and feeds tl.dot (fp32 accumulation). BLOCK_K divides the group
size, so each K step reads one scale (and zero) per output row. Decoding is memory-bound, so the
point is reading 1 or 0.5 bytes per weight instead of 2; one kernel serves both widths through the
BITS constexpr.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.quant.int4_layout import int4_as_float, int4_period, unpack_int4


@triton.jit
def _dequant_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] int8 or [N, K/8] int32 (interleaved int4)
    scale_ptr,  # [N] (BITS=8) or [N, K/G] (BITS=4)
    zero_ptr,  # [N, K/G] (BITS=4)
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PERIOD: tl.constexpr,  # int4: features per interleaving period
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # clamp instead of masking weight loads
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=(offs_m[:, None] < M) & mask_k[None, :])
        if BITS == 8:
            w = tl.load(w_ptr + rows_n[:, None] * stride_wn + k[None, :], mask=mask_k[None, :], other=0)
            w = w.to(x.dtype)
        else:
            words_per_period: tl.constexpr = PERIOD // 8
            word = (k // PERIOD) * words_per_period + k % words_per_period
            shift = ((k % PERIOD) // words_per_period) * 4
            packed = tl.load(w_ptr + rows_n[:, None] * stride_wn + word[None, :], mask=mask_k[None, :], other=0)
            q = ((packed >> shift[None, :]) & 0xF).to(tl.float32)
            group = k0 // GROUP_SIZE
            scale = tl.load(scale_ptr + rows_n * stride_sn + group).to(tl.float32)
            zero = tl.load(zero_ptr + rows_n * stride_sn + group).to(tl.float32)
            w = ((q - zero[:, None]) * scale[:, None]).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    if BITS == 8:
        acc *= tl.load(scale_ptr + rows_n).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # int32 [N, K/8], interleaved in periods of 128 features (16 words)
    scale_ptr,  # [N, K/G]
    zero_ptr,  # [N, K/G]
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    one_bits,  # 0x3F800000, the bits of 1.0, as an argument (see int4_as_float)
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The int4 layout's own GEMM: nibble i of a period's 16 words is a contiguous run of 16 features, so
    each period is eight [BLOCK_M, 16] x [16, BLOCK_N] dots, each weight unpacked with one shift, one mask
    and one FMA (w = 16 s f - (16 + z) s with f = 1 + q/16) and dequantized once for all BLOCK_M rows."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    mask_m = offs_m < M
    offs_w = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 128):
        words = tl.load(w_ptr + rows_n[None, :] * stride_wn + (k0 // 8 + offs_w)[:, None])  # [16, BLOCK_N]
        group = k0 // GROUP_SIZE
        scale = tl.load(scale_ptr + rows_n * stride_sn + group).to(tl.float32)
        zero = tl.load(zero_ptr + rows_n * stride_sn + group).to(tl.float32)
        scale16 = (16.0 * scale)[None, :]
        offset = (-(16.0 + zero) * scale)[None, :]
        for i in tl.static_range(8):
            f = int4_as_float(words, one_bits, i)
            w = (f * scale16 + offset).to(x_ptr.dtype.element_ty)  # [16, BLOCK_N]
            k = k0 + i * 16 + offs_w
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None], other=0.0)
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def dequant_matmul(
    x: torch.Tensor,  # [M, K] float
    weight: torch.Tensor,  # int8 [N, K] or int32 [N, K/8] (interleaved int4)
    scale: torch.Tensor,  # [N] or [N, K/G]
    zero: torch.Tensor | None = None,  # [N, K/G] (int4)
    bias: torch.Tensor | None = None,
    *,
    bits: int = 8,
    group_size: int = 0,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """[M, N] in x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    if bits == 4 and int4_period(group_size) == 128:
        return _int4_matmul(x, weight, scale, zero, bias, group_size)
    if bits == 4:  # one scale/zero per row per K step: BLOCK_K divides the group
        block_k = min(block_k, group_size)
        assert zero is not None and group_size % block_k == 0 and k % group_size == 0, (group_size, block_k, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _dequant_matmul_kernel[grid](
        x,
        weight,
        scale,
        zero if zero is not None else scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        BITS=bits,
        GROUP_SIZE=max(group_size, 1),
        PERIOD=int4_period(group_size) if bits == 4 else 8,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def _int4_matmul(x, weight, scale, zero, bias, group_size: int) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    assert zero is not None and zero.stride() == scale.stride() and k % group_size == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(m)))  # the weights are dequantized once per M block
    block_n = 64
    _int4_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        weight,
        scale,
        zero,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        0x3F800000,
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
        num_stages=3,
    )
    return out


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, *, bits: int = 8, group_size: int = 0
) -> torch.Tensor:
    """The float32 [N, K] weight the kernel multiplies by."""
    if bits == 8:
        return weight.float() * scale.float()[:, None]
    assert zero is not None, "int4 weights carry zero points"
    q = unpack_int4(weight, int4_period(group_size)).float()
    return (q - zero.float().repeat_interleave(group_size, 1)) * scale.float().repeat_interleave(group_size, 1)


def dequant_matmul_ref(x, weight, scale, zero=None, bias=None, *, bits: int = 8, group_size: int = 0) -> torch.Tensor:
    out = x.float() @ dequantize_weight(weight, scale, zero, bits=bits, group_size=group_size).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
