"""RMSNorm over the last dim, optionally fused with the residual add that precedes it, and Gemma's
"norm, add, norm" (a sandwich-norm layer's post-sublayer norm, the residual add and the next pre-norm).

With a residual the kernel computes s = x + residual (rounded to the activation dtype, as an
unfused model would store it), writes s to `residual_out` (which may be `residual` itself), and
normalizes s. That is the decoder-layer pattern: one read of x and residual, one write of each output.

`norm_add_rmsnorm` puts one more norm in front: s = residual + rmsnorm(x, w1), out = rmsnorm(s, w2), with
every intermediate rounded as the three unfused ops round it. `qk_rmsnorm` norms the q and k heads of a
fused qkv output in place, each group by its own weight (Qwen3 / Gemma 3). These kernels, and
tgi_compat/kernels/quant/per_token.py's norm + quantize, share the jit helpers below (`add_residual`,
`rounded_sum`, `rms_normalize`), so they cannot drift apart in their roundings.

Those roundings hold on the GPU only if the compiler keeps them: the NVPTX backend shrinks a rounded product
of two half-precision values and the add after it into one half-precision FMA, which rounds once where the
unfused ops round twice (Gemma's residual sum came out a bf16 ulp off in about a third of its elements). The
weight product is therefore an `mul_uncontracted`, which no FMA absorbs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tgi_compat.kernels.pdl import launch_options, use_pdl_for_one_request

# Triton's interpreter has no libdevice; it fuses nothing either, so a plain product rounds the same there.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mul_uncontracted(a, b):
    """a * b in fp32, rounded on its own: never fused with a later add into one FMA (libdevice's mul_rn)."""
    if _INTERPRETED:
        product = a * b
    else:
        product = libdevice.mul_rn(a, b)
    return product


@triton.jit
def rounded_sum(x, residual):
    """x + residual rounded to x's dtype, as an unfused add stores it."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)


@triton.jit
def add_residual(x, residual_ptr, residual_out_ptr, offs, mask):
    """x + residual (`rounded_sum`), also written to residual_out."""
    s = rounded_sum(x, tl.load(residual_ptr + offs, mask=mask, other=0.0))
    tl.store(residual_out_ptr + offs, s, mask=mask)
    return s


@triton.jit
def rms_normalize(x, w, eps, NUM_COLS: tl.constexpr):
    """rmsnorm(x) * w over x's last axis, as fp32 for the caller to round once: normalised in fp32, rounded to
    the activation dtype, then scaled (HF's order of roundings; the fp32 product of two half-precision values
    is exact, so rounding it equals the half-precision multiply); masked lanes of x must be 0."""
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=len(x.shape) - 1, keep_dims=True) / NUM_COLS + eps)
    normed = (xf * inv_rms).to(x.dtype)
    return mul_uncontracted(normed.to(tl.float32), w.to(tl.float32))


@triton.jit
def load_weight(weight_ptr, offs, mask):
    return tl.load(weight_ptr + offs, mask=mask, other=0.0)


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
    USE_PDL: tl.constexpr = False,  # launched as a programmatic dependent (tgi_compat/kernels/pdl.py)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_COLS
    w = load_weight(weight_ptr, offs, mask)  # before the wait: no kernel writes it
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # one program: the next kernel may launch while it runs
        tl.extra.cuda.gdc_wait()  # x and the residual are the previous kernels' output
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = add_residual(x, residual_ptr + row * stride_r, residual_out_ptr + row * stride_ro, offs, mask)
    y = rms_normalize(x, w, eps, NUM_COLS)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_add_norm_kernel(
    x_ptr,  # [N, C]
    x_weight_ptr,  # [C]: x's own norm
    residual_ptr,  # [N, C]
    residual_out_ptr,  # [N, C], receives residual + rmsnorm(x) (may alias residual_ptr)
    weight_ptr,  # [C]: the norm of the sum
    out_ptr,  # [N, C]
    stride_x,
    stride_r,
    stride_ro,
    stride_o,
    x_eps,
    eps,
    NUM_COLS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_COLS
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    # x's norm is stored in x's dtype by the unfused op: round it there before the add
    x = rms_normalize(x, load_weight(x_weight_ptr, offs, mask), x_eps, NUM_COLS).to(x_ptr.dtype.element_ty)
    s = add_residual(x, residual_ptr + row * stride_r, residual_out_ptr + row * stride_ro, offs, mask)
    y = rms_normalize(s, load_weight(weight_ptr, offs, mask), eps, NUM_COLS)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_kernel(
    qk_ptr,  # [T, Hq + Hkv, D], token stride stride_t, head stride stride_h: normalised in place
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D]
    stride_t,
    stride_h,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,  # Hq + Hkv
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Qwen3 / Gemma 3's per-head q and k norms: one program per token, all its heads at once."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    mask_d = offs < HEAD_DIM
    mask = (heads < NUM_HEADS)[:, None] & mask_d[None, :]
    ptrs = qk_ptr + token * stride_t + heads[:, None] * stride_h + offs[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    q_w = load_weight(q_weight_ptr, offs, mask_d)[None, :]
    k_w = load_weight(k_weight_ptr, offs, mask_d)[None, :]
    w = tl.where((heads < NUM_Q_HEADS)[:, None], q_w, k_w)
    y = rms_normalize(x, w, eps, HEAD_DIM)
    tl.store(ptrs, y.to(qk_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, t.shape[-1])


def _row_launch(num_cols: int) -> dict:
    block = triton.next_power_of_2(num_cols)
    return dict(NUM_COLS=num_cols, BLOCK=block, num_warps=min(16, max(1, block // 256)))


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
    out2 = _rows(out)
    res2 = _rows(residual) if residual is not None else x2
    res_out2 = _rows(residual_out) if residual_out is not None else res2
    if x2.shape[0] == 0:
        return out
    pdl = use_pdl_for_one_request(x2, x2.shape[0])
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
        HAS_RESIDUAL=residual is not None,
        USE_PDL=pdl,
        **_row_launch(num_cols),
        **launch_options(pdl),
    )
    return out


def norm_add_rmsnorm(
    x: torch.Tensor,  # [..., C]
    x_weight: torch.Tensor,  # [C]
    x_eps: float,
    residual: torch.Tensor,  # [..., C]
    weight: torch.Tensor,  # [C]
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,  # receives residual + rmsnorm(x); default: residual, in place
) -> torch.Tensor:
    """rmsnorm(residual + rmsnorm(x, x_weight), weight) in one launch; the sum goes to residual_out."""
    num_cols = x.shape[-1]
    x2 = x.reshape(-1, num_cols)
    assert x2.stride(-1) == 1 and residual.shape == x.shape
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out2, res2 = _rows(out), _rows(residual)
    res_out2 = _rows(residual_out) if residual_out is not None else res2
    if x2.shape[0] == 0:
        return out
    _norm_add_norm_kernel[(x2.shape[0],)](
        x2,
        x_weight,
        res2,
        res_out2,
        weight,
        out2,
        x2.stride(0),
        res2.stride(0),
        res_out2.stride(0),
        out2.stride(0),
        x_eps,
        eps,
        **_row_launch(num_cols),
    )
    return out


def qk_rmsnorm(
    qk: torch.Tensor,  # [T, Hq + Hkv, D], D contiguous (the q|k view of a fused qkv output)
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    num_q_heads: int,
) -> torch.Tensor:
    """RMSNorm of every head in place, q heads by q_weight and k heads by k_weight (one launch); returns qk."""
    num_tokens, num_heads, head_dim = qk.shape
    assert qk.stride(2) == 1
    if num_tokens == 0:
        return qk
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _qk_norm_kernel[(num_tokens,)](
        qk,
        q_weight,
        k_weight,
        qk.stride(0),
        qk.stride(1),
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=min(16, max(1, block_h * block_d // 1024)),
    )
    return qk


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if residual is not None:
        residual.copy_((x.float() + residual.float()).to(residual.dtype))
        x = residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * weight).to(x.dtype)


def norm_add_rmsnorm_ref(
    x: torch.Tensor, x_weight: torch.Tensor, x_eps: float, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The three unfused ops; residual becomes residual + rmsnorm(x, x_weight) in place."""
    return rmsnorm_ref(rmsnorm_ref(x, x_weight, x_eps), weight, eps, residual=residual)


def qk_rmsnorm_ref(
    qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_q_heads: int
) -> torch.Tensor:
    """A new [T, Hq + Hkv, D]: the q heads normed by q_weight, the k heads by k_weight."""
    q = rmsnorm_ref(qk[:, :num_q_heads], q_weight, eps)
    k = rmsnorm_ref(qk[:, num_q_heads:], k_weight, eps)
    return torch.cat((q, k), dim=1)
