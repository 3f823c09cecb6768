"""Few-row matrix-vector product (decode at batch 1 to ~8) with the preceding elementwise op fused in,
reading a half-precision weight or a quantized one that it dequantizes in registers.

At small batch a decoder layer is four weight reads (q|k|v, o, gate|up, down) separated by small
elementwise kernels (RMSNorm with the residual add, SiLU-and-mul). Those kernels move almost no bytes
but each costs a launch and a gap in the CUDA graph; fused into the GEMV's prologue they cost nothing:

    PROLOGUE_NONE      y = W x
    PROLOGUE_RMSNORM   y = W rmsnorm(x [+ residual])   (x + residual also written out, by program 0)
    PROLOGUE_SILU_MUL  y = W (silu(x[:K]) * x[K:])
    PROLOGUE_GELU_TANH_MUL  y = W (gelu_tanh(x[:K]) * x[K:])   (Gemma's GeGLU)
    PROLOGUE_NORM_ADD_NORM  y = W rmsnorm(residual + rmsnorm(x, w1))   (Gemma 2/3's post-sublayer norm, the
                       residual add and the next pre-norm; residual + rmsnorm(x, w1) also written out)

The weight is read in one of three formats (`QuantizedWeight` describes the quantized ones):

    WEIGHT_DENSE       W [N, K] fp16/bf16/fp32
    WEIGHT_ROW_SCALED  W [N, K] int8 or float8_e4m3fn, w[n, k] = W[n, k] * scale[n] (per channel; a
                       scale of stride 0 is per tensor)
    WEIGHT_INT4        W int32 [N, K/8], eight nibbles a word in tgi_compat/kernels/quant/int4_layout.py's interleaved
                       layout, w[n, k] = (q[n, k] - zero[n, k/G]) * scale[n, k/G], integer zero points

Weight-only: activations stay in their half precision, so reading 1 or 1/2 byte per weight instead of
2 is the whole gain at these row counts. RMSNorm needs the row's sum of squares, which is only known at
the end of the K walk: the kernels accumulate W (h * norm_weight) and scale by 1/rms afterwards (a scalar
per row commutes with the dot product). So in half precision they skip the unfused path's two intermediate
roundings of the normed activation (tgi_compat/kernels/elementwise/rmsnorm.py); the result is the more exact
one and within the dtype's tolerance of it. NORM_ADD_NORM needs x's own 1/rms before its main loop: each
program first reads x's row once from L2 for it, then runs RMSNORM's loop on residual + rmsnorm(x, w1),
rounded to the dtype where the unfused norm and add store their outputs. SiLU-and-mul rounds its output
to the input dtype like tgi_compat/kernels/elementwise/silu_mul.py. Accumulation is fp32, elementwise over the
K block (one row) or over [rows, K block] (several), reduced once at the end.

Three kernels share the prologue (prologue.py) and the epilogue (epilogue.py): dense.py's reads [BLOCK_N, BLOCK_K]
tiles of a dense or 1-byte weight, int4.py's [BLOCK_N, periods, words] tiles of an int4 one, and at one row a
config may select int4_one_row.py's (`GemvConfig.one_row`: 2-D weight loads, integer dp4a products). The int4
kernels' few weight rows a program make the fused prologue a large share of their instructions, so a config may
run the prologue as its own kernel instead (`GemvConfig.separate_prologue`, any weight format).

On Hopper the kernels are launched as programmatic dependents (PDL) of the kernel before them: each reads
its first weight block, then waits for that kernel's output, and lets the next kernel start once its
own main loop is done, so consecutive GEMVs overlap one's tail with the next one's first reads.
"""

from __future__ import annotations

import dataclasses

import torch

from tgi_compat.kernels.comm.one_shot_all_reduce import PushTarget
from tgi_compat.kernels.elementwise import rmsnorm as rmsnorm_module
from tgi_compat.kernels.elementwise import silu_mul as silu_mul_module
from tgi_compat.kernels.gemv.config import gemv_config_for, int4_config, is_power_of_2
from tgi_compat.kernels.gemv.dense import launch_dense
from tgi_compat.kernels.gemv.int4 import launch_int4
from tgi_compat.kernels.gemv.int4_one_row import launch_int4_one_row
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_GELU_TANH_MUL,
    PROLOGUE_NONE,
    PROLOGUE_NORM_ADD_NORM,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    WEIGHT_INT4,
    Activations,
    GemvConfig,
    QuantizedWeight,
)
from tgi_compat.kernels.pdl import use_pdl


def few_rows_gemv(weight: QuantizedWeight | None, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The GEMV over a quantized weight when x is the few rows of decoding on CUDA (it reads 1 or 1/2 byte
    a weight where the GEMM paths are built for more rows); None: the caller takes its own path."""
    if weight is None:
        return None
    config = gemv_config_for(x, weight, PROLOGUE_NONE)
    return gemv(x, weight, bias, config=config) if config is not None else None


def gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul; M small (decode rows)
    weight: torch.Tensor | QuantizedWeight,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: apply RMSNorm (eps) to x first
    eps: float = 0.0,
    residual: torch.Tensor | None = None,  # [M, K]: normalise x + residual (RMSNorm only)
    residual_out: torch.Tensor | None = None,  # [M, K]: receives x + residual
    x_norm_weight: torch.Tensor | None = None,  # [K]: x is RMS-normed by it (x_eps) before the residual add
    x_eps: float = 0.0,
    silu_mul: bool = False,
    gelu_tanh: bool = False,  # with silu_mul: the gate's activation is tanh-approximated GELU (GeGLU)
    config: GemvConfig | None = None,
    push: PushTarget | None = None,  # send the output to the other ranks as it is stored (not int4)
) -> torch.Tensor:
    """Returns [M, N] in x's dtype. With `push`, the caller finishes the sum over the ranks with
    tgi_compat.kernels.comm.one_shot_all_reduce.one_shot_all_reduce_(out, ..., sent=True)."""
    n, k = weight.shape
    m = x.shape[0]
    assert x.stride(-1) == 1 and x.shape[1] == (2 * k if silu_mul else k), (tuple(x.shape), (n, k))
    prologue = _prologue(silu_mul, gelu_tanh, norm_weight is not None, x_norm_weight is not None, residual is not None)
    if residual is not None:
        assert residual_out is not None and residual.is_contiguous() and residual_out.is_contiguous()
        assert residual.shape == (m, k) and residual_out.data_ptr() != residual.data_ptr(), "program 0 writes it"
    int4_weight = _int4_weight(weight)
    if config is None and int4_weight is not None:
        config = int4_config(k, m, int4_weight.group_size, n, prologue)
    if config is not None and config.separate_prologue and prologue != PROLOGUE_NONE:
        x = _prologue_alone(x, gelu_tanh, norm_weight, eps, residual, residual_out, x_norm_weight, x_eps)
        return gemv(x, weight, bias, config=dataclasses.replace(config, separate_prologue=False), push=push)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    acts = Activations(x, _or_x(residual, x), _or_x(residual_out, x), _or_x(norm_weight, x))
    pdl = use_pdl(x)
    has_residual = residual is not None
    if int4_weight is None:
        launch_dense(acts, x_norm_weight, weight, bias, out, eps, x_eps, prologue, has_residual, config, pdl, push)
    else:
        assert push is None, "the int4 kernels do not push"
        _launch_int4(acts, int4_weight, bias, out, eps, prologue, has_residual, config, pdl)
    return out


def _prologue(silu_mul: bool, gelu_tanh: bool, norm: bool, x_norm: bool, residual: bool) -> int:
    """The PROLOGUE_* that `gemv`'s arguments ask for."""
    assert not (silu_mul and norm)
    assert silu_mul or not gelu_tanh, "gelu_tanh selects the gated prologue's activation"
    assert norm or not residual, "the residual is added before the norm"
    assert norm and residual or not x_norm, "x's norm goes before a residual add and a norm"
    if silu_mul:
        return PROLOGUE_GELU_TANH_MUL if gelu_tanh else PROLOGUE_SILU_MUL
    if x_norm:
        return PROLOGUE_NORM_ADD_NORM
    return PROLOGUE_RMSNORM if norm else PROLOGUE_NONE


def _prologue_alone(
    x: torch.Tensor,
    gelu_tanh: bool,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    x_norm_weight: torch.Tensor | None,
    x_eps: float,
) -> torch.Tensor:
    """f(x) by the prologue's own kernel (`GemvConfig.separate_prologue`): the GEMV then reads it as it is."""
    if norm_weight is None:
        return silu_mul_module.silu_mul(x, gelu_tanh=gelu_tanh)
    if x_norm_weight is not None:
        assert residual is not None
        return rmsnorm_module.norm_add_rmsnorm(
            x, x_norm_weight, x_eps, residual, norm_weight, eps, residual_out=residual_out
        )
    return rmsnorm_module.rmsnorm(x, norm_weight, eps, residual=residual, residual_out=residual_out)


def _int4_weight(weight: torch.Tensor | QuantizedWeight) -> QuantizedWeight | None:
    return weight if isinstance(weight, QuantizedWeight) and weight.format == WEIGHT_INT4 else None


def _or_x(tensor: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """An absent operand's stand-in: x (the kernel never reads it)."""
    return tensor if tensor is not None else x


def _launch_int4(
    acts: Activations,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
    prologue: int,
    has_residual: bool,
    config: GemvConfig | None,
    pdl: bool,
) -> None:
    """The int4 tile kernel, or at one row the one-row kernel where the config says so."""
    (m, n), k, group_size = out.shape, weight.shape[1], weight.group_size
    assert prologue != PROLOGUE_NORM_ADD_NORM, "the int4 kernels have no NORM_ADD_NORM prologue"
    assert weight.zero is not None and weight.zero.stride() == weight.scale.stride() and k % group_size == 0
    assert is_power_of_2(group_size) and weight.data.stride(1) == 1, group_size
    config = config or int4_config(k, m, group_size, n, prologue)
    launch = launch_int4_one_row if config.one_row and m == 1 else launch_int4
    launch(acts, weight, bias, out, eps, prologue, has_residual, config, pdl)


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    gelu_tanh: bool = False,
    x_norm_weight: torch.Tensor | None = None,
    x_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, x + residual or None) with the unfused kernels' roundings, product in fp32 with the dequantized weight;
    with x_norm_weight, x is rmsnorm(x, x_norm_weight) first."""
    summed = None
    if silu_mul:
        x = silu_mul_module.gelu_tanh_mul_ref(x) if gelu_tanh else silu_mul_module.silu_mul_ref(x)
    elif norm_weight is not None:
        if x_norm_weight is not None:
            x = rmsnorm_module.rmsnorm_ref(x, x_norm_weight, x_eps)
        if residual is not None:
            summed = (x.float() + residual.float()).to(x.dtype)
        x = rmsnorm_module.rmsnorm_ref(summed if summed is not None else x, norm_weight, eps)
    w = weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()
    y = x.float() @ w.T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype), summed
