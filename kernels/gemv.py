"""One-row matrix-vector product (batch-1 decode) with the preceding elementwise op fused in.

At batch 1 a decoder layer is four weight reads (q|k|v, o, gate|up, down) separated by small
elementwise kernels (RMSNorm with the residual add, SiLU-and-mul). Those kernels move almost no bytes
but each costs a launch and a gap in the CUDA graph; fused into the GEMV's prologue they cost nothing:

    PROLOGUE_NONE      y = W x
    PROLOGUE_RMSNORM   y = W rmsnorm(x [+ residual])   (x + residual also written out, by program 0)
    PROLOGUE_SILU_MUL  y = W (silu(x[:K]) * x[K:])

Each program owns BLOCK_N output rows and walks the whole K once, so there is no split-K reduction;
the prologue is recomputed per program from L2 (K elements, against BLOCK_N * K weight bytes from HBM).
RMSNorm needs the row's sum of squares, which is only known at the end of the walk: the kernel
accumulates W (h * norm_weight) and scales by 1/rms afterwards (a scalar per row commutes with the dot
product). So in half precision it skips the unfused path's two intermediate roundings of the normed
activation (kernels/rmsnorm.py); the result is the more exact one and within the dtype's tolerance of
it. SiLU-and-mul rounds its output to the input dtype like kernels/silu_mul.py. Accumulation is fp32.

On Hopper the kernel is launched as a programmatic dependent (PDL) of the kernel before it: it reads
its first weight block, then waits for that kernel's output, and lets the next kernel start once its
own main loop is done, so consecutive GEMVs overlap one's tail with the next one's first reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl

PROLOGUE_NONE = 0
PROLOGUE_RMSNORM = 1
PROLOGUE_SILU_MUL = 2


@triton.jit
def _load_summed(x_ptr, residual_ptr, offs_k, mask_k, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """x[k] (+ residual[k]) rounded to x's dtype, as an unfused residual add would store it."""
    if EVEN_K:
        h = tl.load(x_ptr + offs_k)
    else:
        h = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
    if HAS_RESIDUAL:
        if EVEN_K:
            res = tl.load(residual_ptr + offs_k)
        else:
            res = tl.load(residual_ptr + offs_k, mask=mask_k, other=0.0)
        h = (h.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h


@triton.jit
def _activation_block(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    norm_weight_ptr,
    offs_k,
    K,
    pid,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """(f(x)[offs_k] in fp32 (before the 1/rms scale), its squares for the RMS or zeros)."""
    mask_k = offs_k < K
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:
        h = _load_summed(x_ptr, residual_ptr, offs_k, mask_k, HAS_RESIDUAL, EVEN_K)
        if HAS_RESIDUAL:
            if pid == 0:
                tl.store(residual_out_ptr + offs_k, h, mask=mask_k)
        hf = h.to(tl.float32)
        xk = hf * tl.load(norm_weight_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        squares = hf * hf
    elif PROLOGUE == 2:
        gate = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        xk = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)
        squares = tl.zeros_like(xk)
    else:
        xk = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        squares = tl.zeros_like(xk)
    return xk, squares


@triton.jit
def _weight_block(w_ptr, rows, stride_wn, offs_k, K, EVEN_K: tl.constexpr):
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K], or [2K] for SILU_MUL
    residual_ptr,  # [K], read when HAS_RESIDUAL
    residual_out_ptr,  # [K], receives x + residual when HAS_RESIDUAL (never aliases residual)
    norm_weight_ptr,  # [K], RMSNORM only
    w_ptr,  # [N, K], row stride stride_wn, K contiguous
    bias_ptr,  # [N], when HAS_BIAS
    out_ptr,  # [N]
    N,
    K,
    stride_wn,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the previous kernel (Hopper)
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)  # clamp instead of masking the weight loads
    offs = tl.arange(0, BLOCK_K)

    # The first weight block is read before waiting on the previous kernel: no kernel writes
    # weights, so under programmatic dependent launch this read overlaps that kernel's tail.
    w = _weight_block(w_ptr, rows, stride_wn, offs, K, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the activations below are the previous kernel's output
    xk, sum_sq = _activation_block(
        x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, offs, K, pid, PROLOGUE, HAS_RESIDUAL, EVEN_K
    )
    acc = w.to(tl.float32) * xk[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + offs
        w = _weight_block(w_ptr, rows, stride_wn, offs_k, K, EVEN_K)
        xk, squares = _activation_block(
            x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, offs_k, K, pid, PROLOGUE, HAS_RESIDUAL, EVEN_K
        )
        sum_sq += squares
        acc += w.to(tl.float32) * xk[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own weight reads

    y = tl.sum(acc, 1)
    if PROLOGUE == 1:  # 1/rms is one scalar per row: it commutes with the dot product
        y *= 1.0 / tl.sqrt(tl.sum(sum_sq, 0) / K + eps)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


# Best configs from scripts/device/tune_gemv.py on an H200, bf16, for the projections of Llama-3-8B
# and Qwen2-7B (key: N, K, prologue). None: the unfused pair (cuBLAS) was faster for that shape.
TUNED: dict[tuple[int, int, int], GemvConfig | None] = {
    (6144, 4096, PROLOGUE_RMSNORM): GemvConfig(16, 512, 4, 2),
    (4096, 4096, PROLOGUE_NONE): GemvConfig(4, 1024, 4, 1),
    (28672, 4096, PROLOGUE_RMSNORM): GemvConfig(8, 1024, 4, 1),
    (4096, 14336, PROLOGUE_SILU_MUL): GemvConfig(4, 1024, 4, 1),
    (128256, 4096, PROLOGUE_NONE): GemvConfig(2, 1024, 4, 1),
    (4608, 3584, PROLOGUE_RMSNORM): GemvConfig(4, 512, 4, 2),
    (3584, 3584, PROLOGUE_NONE): GemvConfig(4, 128, 8, 2),
    (37888, 3584, PROLOGUE_RMSNORM): GemvConfig(8, 512, 4, 4),
    (3584, 18944, PROLOGUE_SILU_MUL): None,
}


def gemv_config(n: int, k: int, prologue: int) -> GemvConfig | None:
    """The tuned config of this shape, else a rule of thumb from the tuning runs; None: do not fuse."""
    if (n, k, prologue) in TUNED:
        return TUNED[(n, k, prologue)]
    block_k = next((b for b in (1024, 512, 256, 128) if k % b == 0), 512)
    return GemvConfig(block_n=8 if prologue == PROLOGUE_RMSNORM else 4, block_k=block_k, num_warps=4, num_stages=1)


def gemv(
    x: torch.Tensor,  # [1, K], or [1, 2K] with silu_mul
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: apply RMSNorm (eps) to x first
    eps: float = 0.0,
    residual: torch.Tensor | None = None,  # [1, K]: normalise x + residual (RMSNorm only)
    residual_out: torch.Tensor | None = None,  # [1, K]: receives x + residual
    silu_mul: bool = False,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Returns [1, N] in x's dtype."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(1) == 1
    assert x.shape[1] == (2 * k if silu_mul else k), (tuple(x.shape), tuple(weight.shape))
    assert not (silu_mul and norm_weight is not None)
    prologue = PROLOGUE_SILU_MUL if silu_mul else PROLOGUE_RMSNORM if norm_weight is not None else PROLOGUE_NONE
    if residual is not None:
        assert prologue == PROLOGUE_RMSNORM and residual_out is not None
        assert residual_out.data_ptr() != residual.data_ptr(), "program 0 writes residual_out while others read"
    config = config or gemv_config(n, k, prologue) or GemvConfig()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)
    dummy = x
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        residual if residual is not None else dummy,
        residual_out if residual_out is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
        weight,
        bias if bias is not None else dummy,
        out,
        n,
        k,
        weight.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, x + residual or None) with the unfused kernels' roundings, product in fp32."""
    from kernels.rmsnorm import rmsnorm_ref
    from kernels.silu_mul import silu_mul_ref

    summed = None
    if silu_mul:
        x = silu_mul_ref(x)
    elif norm_weight is not None:
        if residual is not None:
            summed = (x.float() + residual.float()).to(x.dtype)
        x = rmsnorm_ref(summed if summed is not None else x, norm_weight, eps)
    y = x.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype), summed
