"""A gated MLP's first GEMM with its activation in the epilogue: out[M, I] = act(x @ gate^T + b_gate) * (x @ up^T +
b_up), from one [gate | up] weight [2P, K] (gate's rows first, each half padded to P >= I rows).

cuBLAS's [gate | up] GEMM writes the [M, 2P] product and a second pass reads it back for SiLU-and-mul: for Qwen2.5-VL's
vision MLP (K 1280, P 3456) that is ~150 MB of the 190 MB moved per block and 1024px image, ~2 ms of its ~17 ms on an
H100 (docs/benchmarks/2026-12-07-session-40.md). Here a program owns one [BLOCK_M, BLOCK_N] tile of the output, keeps
the gate's and the up's accumulators side by side over K, and writes only the activated tile, once (the same fp32
math as kernels/elementwise/silu_mul.py, with one rounding where cuBLAS + silu_mul round the products first)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tgi_compat.kernels.elementwise.silu_mul import gated_activation


class GatedGemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles that walk the column tiles together, so each weight tile is read from L2
    tma: bool = True  # tensor-memory-accelerator loads (Hopper; the interpreter runs them too) over pointer loads


# benchmarks/device/gated_gemm.py sweeps the configs on the GPU; this one is the default until it says otherwise
DEFAULT_CONFIG = GatedGemmConfig(128, 128, 64, 8, 3)


def _tma_ok(device: torch.device, *tensors: torch.Tensor) -> bool:
    """Hopper and newer (or the interpreter's CPU tensors), 16-byte aligned bases and rows."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


@triton.jit(do_not_specialize=["num_rows"])  # one compile for every row count: no compile mid-serving
def _gated_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [2P, K]: gate's P rows, then up's
    bias_ptr,  # [2P] (unused without HAS_BIAS)
    out_ptr,  # [M, I]
    x_desc,  # TMA: x's [BLOCK_M, BLOCK_K] boxes and each half's [BLOCK_N, BLOCK_K] (else unused)
    gate_desc,
    up_desc,
    num_rows,
    inner,  # I: the output's columns
    padded,  # P: the rows of each half of the weight
    hidden,  # K
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GELU_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(inner, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < num_rows
    mask_n = offs_n < inner
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    gate_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + padded * stride_wn
    for start in range(0, hidden, BLOCK_K):
        if TMA:  # each descriptor covers one half: its boxes read zeros past the half's last row and past K
            x = x_desc.load([pid_m * BLOCK_M, start])
            gate = gate_desc.load([pid_n * BLOCK_N, start])
            up = up_desc.load([pid_n * BLOCK_N, start])
        else:
            in_k = start + offs_k < hidden
            x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
            gate = tl.load(gate_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
            up = tl.load(up_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        acc_gate = tl.dot(x, tl.trans(gate), acc_gate)
        acc_up = tl.dot(x, tl.trans(up), acc_up)
    if HAS_BIAS:
        acc_gate += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_ptr + padded + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = gated_activation(acc_gate, acc_up, GELU_TANH)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gated_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    inner: int | None = None,
    gelu_tanh: bool = False,
    config: GatedGemmConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """x [M, K], weight [2P, K] ([gate | up]), bias [2P] -> act(gate) * up [M, inner] (inner: P unless given, the
    unpadded width whose columns are kept)."""
    num_rows, hidden = x.shape
    padded = weight.shape[0] // 2
    inner = padded if inner is None else inner
    assert weight.shape == (2 * padded, hidden) and inner <= padded
    assert x.stride(1) == 1 and weight.stride(1) == 1 and (bias is None or bias.is_contiguous())
    out = torch.empty(num_rows, inner, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    cfg = config
    x_desc: torch.Tensor | TensorDescriptor = x  # unused without TMA
    gate_desc: torch.Tensor | TensorDescriptor = weight
    up_desc: torch.Tensor | TensorDescriptor = weight
    gate, up = weight[:padded], weight[padded:]
    tma = cfg.tma and _tma_ok(x.device, x, gate, up)
    if tma:
        x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
        gate_desc = TensorDescriptor.from_tensor(gate, [cfg.block_n, cfg.block_k])
        up_desc = TensorDescriptor.from_tensor(up, [cfg.block_n, cfg.block_k])
    grid = (triton.cdiv(num_rows, cfg.block_m) * triton.cdiv(inner, cfg.block_n),)
    _gated_gemm_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,
        out,
        x_desc,
        gate_desc,
        up_desc,
        num_rows,
        inner,
        padded,
        hidden,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        GELU_TANH=gelu_tanh,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def gated_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, inner: int | None = None
) -> torch.Tensor:
    """The same in float32 torch ops (SwiGLU)."""
    padded = weight.shape[0] // 2
    both = x.float() @ weight.float().t()
    if bias is not None:
        both = both + bias.float()
    gate, up = both[:, :padded], both[:, padded:]
    out = torch.nn.functional.silu(gate) * up
    return out[:, : padded if inner is None else inner].to(x.dtype)
