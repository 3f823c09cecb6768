"""Row-wise scaled FP8 GEMM for the skinny products of batched decoding (tens of rows).

out[M, N] = (x_q[M, K] @ w[N, K]^T) * x_scale[M] * w_scale[N] (+ bias), x_q and w float8_e4m3fn, out in
the model's half dtype. At a few dozen rows the product reads the weight once and does little arithmetic
on it, so it is bound by the weight's bytes; cuBLAS's FP8 GEMM (`torch._scaled_mm`) picks tiles made for
large M there and reads the weight at 23-64% of the copy bandwidth (BENCHMARKS.md). Here one program owns
a BLOCK_M x BLOCK_N tile of the output, streams its BLOCK_N weight rows over K in pipelined BLOCK_K tiles,
and applies both scales (and the bias) once, in the epilogue. Where N / BLOCK_N is small against the SMs
(o and down projections) SPLIT_K programs share a tile's K walk; the last of them to finish adds their
partial sums in split order (deterministic) and resets the tile's counter, in the same launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tgi_compat.kernels.split_k import split_k_scratch
from tgi_compat.kernels.widening import tuned_for


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    # read the tiles through tensor-memory-accelerator descriptors (Hopper; block_k <= 256) instead of pointer
    # loads: the copies run asynchronously to the threads, so a program can keep more stages in flight
    tma: bool = False


# Most rows this kernel takes: at 128 rows `_scaled_mm` wins on the widest projection (BENCHMARKS.md).
MAX_ROWS = 64
# Measured best configs by (rows rounded up to a power of two, N, K): benchmarks/device/fp8_gemm.py on an
# H200, Llama-3-8B's q|k|v, o, gate|up and down projections (BENCHMARKS.md); other shapes take the heuristic below.
TUNED: dict[tuple[int, int, int], Fp8GemmConfig] = {
    (16, 4096, 4096): Fp8GemmConfig(16, 32, 256, 4, 4, 1),
    (32, 4096, 4096): Fp8GemmConfig(32, 64, 256, 4, 4, 2),
    (64, 4096, 4096): Fp8GemmConfig(64, 32, 256, 4, 6, 1, tma=True),
    (16, 4096, 14336): Fp8GemmConfig(16, 64, 256, 4, 4, 4, tma=True),
    (32, 4096, 14336): Fp8GemmConfig(32, 64, 256, 4, 4, 4, tma=True),
    (64, 4096, 14336): Fp8GemmConfig(64, 32, 256, 4, 6, 1, tma=True),
    (16, 6144, 4096): Fp8GemmConfig(16, 32, 256, 4, 4, 1),
    (32, 6144, 4096): Fp8GemmConfig(32, 64, 256, 4, 4, 1, tma=True),
    (64, 6144, 4096): Fp8GemmConfig(64, 64, 256, 8, 5, 1, tma=True),
    (16, 28672, 4096): Fp8GemmConfig(16, 32, 128, 4, 3, 1),
    (32, 28672, 4096): Fp8GemmConfig(32, 32, 128, 4, 3, 1),
    (64, 28672, 4096): Fp8GemmConfig(64, 64, 128, 4, 3, 1),
}


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Hopper and newer; Triton's interpreter (CPU tensors) runs descriptors too."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _tma_compatible(t: torch.Tensor) -> bool:
    """A TMA descriptor needs 16-byte aligned rows (1-byte elements: K a multiple of 16) and base."""
    return t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def row_bucket(num_rows: int) -> int:
    return max(16, triton.next_power_of_2(num_rows))


def fp8_gemm_config(num_rows: int, n: int, k: int) -> Fp8GemmConfig:
    """The tuned config of the shape (or of the tuned N it widens: tgi_compat.kernels.widening), else enough programs
    to keep every SM pulling weight bytes: narrow output slices for narrow N. A widened shape on its base's config:
    the 64-row step's widened GEMMs cost 84 us over the base's, 318-326 us on the rule below (H100, sessions 28-29)."""
    found, tuned = tuned_for(TUNED, (row_bucket(num_rows), n, k), n_index=1)
    if found and tuned is not None:
        return tuned
    block_m = min(row_bucket(num_rows), 64)
    block_n = 32 if n <= 8192 else 64
    return Fp8GemmConfig(block_m, block_n, 256 if k % 256 == 0 else 64, 4, 4)


@triton.jit
def _store_scaled(acc, out_tile, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
    """The epilogue: both scales, the bias, the cast to the output's dtype. out_tile: (out_ptr, offs_m, offs_n,
    mask_m, mask_n, stride_om)."""
    out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om = out_tile
    x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K] float8_e4m3fn
    w_ptr,  # [N, K] float8_e4m3fn
    out_ptr,  # [M, N] bf16 / fp16
    x_scale_ptr,  # [M] float32
    w_scale_ptr,  # [N] float32
    bias_ptr,  # [N] (unused without HAS_BIAS)
    partial_ptr,  # fp32 [tiles, SPLIT_K, BLOCK_M, BLOCK_N] when SPLIT_K > 1
    counter_ptr,  # int32 [tiles], zero between launches, when SPLIT_K > 1
    num_rows,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_om,
    x_desc,  # TMA: x_q's and w's descriptors, blocks [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] (else unused)
    w_desc,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of SPLIT_K * BLOCK_K (always so when SPLIT_K > 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    k_begin = tl.program_id(2) * (k // SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    mask_m = offs_m < num_rows
    mask_n = offs_n < n
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(k_begin, k_begin + k // SPLIT_K, BLOCK_K):
        if TMA:  # out-of-bounds rows and columns of the box read as zeros
            x = x_desc.load([pid_m * BLOCK_M, start])
            w = w_desc.load([pid_n * BLOCK_N, start])
        elif EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            in_k = start + tl.arange(0, BLOCK_K) < k
            x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_tile = (out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om)
    if SPLIT_K == 1:
        _store_scaled(acc, out_tile, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS)
    else:
        # Each program parks its partial tile in its own slot, then counts itself in; the barriers order the
        # CTA's stores before the release of its count (and the acquire before the reads), and the reads
        # bypass L1, which is not coherent between SMs (as tgi_compat/kernels/gemv/epilogue.py's split-K does).
        tile = pid_m * tl.num_programs(0) + pid_n
        offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ptr = partial_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(tile_ptr + tl.program_id(2) * (BLOCK_M * BLOCK_N) + offs_tile, acc)
        tl.debug_barrier()
        count = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if count == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(tile_ptr + split * (BLOCK_M * BLOCK_N) + offs_tile, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + tile, 0)
            _store_scaled(total, out_tile, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS)


def fp8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """x_q [M, K] and weight [N, K] float8_e4m3fn, x_scale [M] or [M, 1] and weight_scale [N] float32."""
    num_rows, k = x_q.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x_q.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(num_rows, n, dtype=out_dtype, device=x_q.device)
    if num_rows == 0:
        return out
    cfg = config or fp8_gemm_config(num_rows, n, k)
    split_k = cfg.split_k if k % (cfg.split_k * cfg.block_k) == 0 else 1
    x_desc, w_desc = x_q, weight  # unused without TMA
    if cfg.tma and _has_tma(x_q.device) and _tma_compatible(x_q) and _tma_compatible(weight):
        assert cfg.block_k <= 256, "a TMA box is at most 256 elements a side"
        x_desc = TensorDescriptor.from_tensor(x_q, [cfg.block_m, cfg.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(num_rows, cfg.block_m), split_k)
    partial, counters = split_k_scratch(out, grid[0] * grid[1], split_k, cfg.block_m * cfg.block_n)
    _fp8_gemm_kernel[grid](
        x_q,
        weight,
        out,
        x_scale.reshape(-1),
        weight_scale.reshape(-1),
        weight_scale if bias is None else bias,
        partial,
        counters,
        num_rows,
        n,
        k,
        x_q.stride(0),
        weight.stride(0),
        out.stride(0),
        x_desc,
        w_desc,
        HAS_BIAS=bias is not None,
        EVEN_K=k % (split_k * cfg.block_k) == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split_k,
        TMA=isinstance(x_desc, TensorDescriptor),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fp8_gemm_ref(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The same product in float32 torch ops."""
    out = (x_q.float() @ weight.float().t()) * x_scale.reshape(-1, 1).float() * weight_scale.reshape(1, -1).float()
    return (out if bias is None else out + bias.float()).to(out_dtype)
