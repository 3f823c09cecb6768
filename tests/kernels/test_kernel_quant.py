"""Quantization kernels against their torch references: per-token activation quantization (FP8 and
int8) and the weight-only dequantizing matmul (int8 per channel, int4 per group)."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.elementwise.rmsnorm import rmsnorm
from tgi_compat.kernels.elementwise.silu_mul import silu_mul
from tgi_compat.kernels.quant.dequant_matmul import dequant_matmul, dequant_matmul_ref
from tgi_compat.kernels.quant.int4_layout import int4_period, pack_int4, unpack_int4
from tgi_compat.kernels.quant.per_token import (
    quant_per_token,
    quant_per_token_ref,
    rmsnorm_quant_per_token,
    silu_mul_quant_per_token,
)


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quant_per_token_is_bit_exact(qdtype: torch.dtype, xdtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 200, generator=gen) * 3).to(xdtype)
    x[1] = 0  # an all-zero row quantizes to zeros, not NaN
    x[2, 5] = 1000  # an outlier sets its row's scale
    q, scale = quant_per_token(x, qdtype, block_k=64)  # several K blocks, the last ragged
    q_ref, scale_ref = quant_per_token_ref(x, qdtype)
    assert q.dtype == qdtype and scale.shape == (6, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    assert not q[1].float().any()


def test_fp8_rounding_carries_into_the_next_exponent():
    # 7.9 must round to 8.0 (mantissa carry), ties go to even
    x = torch.tensor([[448.0, 7.9, -7.9, 1.9608, 17.0, 0.0]])
    q, scale = quant_per_token(x, torch.float8_e4m3fn)
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, 8.0, -8.0, 2.0, 16.0, 0.0]]


@pytest.mark.parametrize("period", [8, 32, 128])
def test_int4_pack_round_trip(period: int):
    q = torch.randint(0, 16, (5, 256), generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q, period)
    assert packed.shape == (5, 32) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed, period), q.to(torch.uint8))


def test_int4_layout_interleaves_each_period():
    q = torch.arange(16).repeat(2).view(1, 32) % 16  # features 0..31 hold 0..15, 0..15
    words = pack_int4(q, 32)[0]  # one period of 4 words: nibble i of word j is feature 4 i + j
    for j in range(4):
        assert [(int(words[j]) >> (4 * i)) & 0xF for i in range(8)] == [(4 * i + j) % 16 for i in range(8)]
    assert int4_period(128) == 128 and int4_period(256) == 128 and int4_period(32) == 32
    with pytest.raises(ValueError):
        int4_period(12)


# bf16 is left to the GPU test: the interpreter's bf16 tl.dot is wrong on CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n", [(1, 40), (19, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_dequant_matmul(dtype: torch.dtype, m: int, n: int, with_bias: bool):
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, 96, generator=gen).to(dtype)
    weight = torch.randint(-127, 128, (n, 96), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 100
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    out = dequant_matmul(x, weight, scale, bias=bias, bits=8, block_m=16, block_n=16, block_k=32)
    ref = dequant_matmul_ref(x, weight, scale, bias=bias, bits=8)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# groups of 32 and 64: the generic gather path; of 128: the layout's own GEMM (two periods of eight dots)
@pytest.mark.parametrize("group_size, block_k", [(32, 32), (64, 32), (128, 64)])
def test_int4_dequant_matmul(dtype: torch.dtype, group_size: int, block_k: int):
    gen = torch.Generator().manual_seed(group_size)
    m, n, k = 3, 72, 256
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = pack_int4(torch.randint(0, 16, (n, k), generator=gen), int4_period(group_size))
    scale = (torch.rand(n, k // group_size, generator=gen) / 50).to(dtype)
    zero = torch.randint(0, 16, (n, k // group_size), generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    kwargs = dict(bits=4, group_size=group_size)
    out = dequant_matmul(x, weight, scale, zero, bias, **kwargs, block_m=16, block_n=16, block_k=block_k)
    ref = dequant_matmul_ref(x, weight, scale, zero, bias, **kwargs)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_quant_gives_the_unfused_pairs_bits(qdtype: torch.dtype, with_residual: bool):
    gen = torch.Generator().manual_seed(3)
    # fp16: the interpreter's bf16 products are wrong on CPU; 200: a masked tail in the row block
    x = (torch.randn(5, 200, generator=gen) * 2).to(torch.float16)
    weight = (1 + 0.1 * torch.randn(200, generator=gen)).to(torch.float16)
    residual = torch.randn(5, 200, generator=gen).to(torch.float16) if with_residual else None
    summed = torch.empty_like(x) if with_residual else None
    q, scale = rmsnorm_quant_per_token(x, weight, 1e-5, qdtype, residual=residual, residual_out=summed)
    unfused_summed = torch.empty_like(x) if with_residual else None
    normed = rmsnorm(x, weight, 1e-5, residual=residual, residual_out=unfused_summed)
    q_ref, scale_ref = quant_per_token(normed, qdtype)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    if with_residual:
        assert torch.equal(summed, unfused_summed)


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8])
def test_silu_mul_quant_gives_the_unfused_pairs_bits(qdtype: torch.dtype):
    x = (torch.randn(4, 2 * 136, generator=torch.Generator().manual_seed(4)) * 3).to(torch.float16)
    q, scale = silu_mul_quant_per_token(x, qdtype)
    q_ref, scale_ref = quant_per_token(silu_mul(x), qdtype)
    assert q.shape == (4, 136)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float())


def test_fp8_projections_take_their_activations_from_the_norm_and_silu_kernels():
    """Triton ops hand an FP8 projection the per-token FP8 output of the fused RMSNorm / SiLU-mul kernels (here
    the emulated FP8 of a CPU): the same product as the unfused torch path's norm, quantization and matmul."""
    from tgi_compat.modeling.layers.linear import Linear
    from tgi_compat.modeling.layers.norm import RMSNorm
    from tgi_compat.modeling.layers.ops import TORCH_OPS
    from tgi_compat.modeling.layers.quantization.fp8 import Fp8LinearMethod
    from tgi_compat.modeling.layers.triton_ops import triton_rms_norm_linear, triton_silu_mul_linear

    gen = torch.Generator().manual_seed(6)
    proj = Linear(64, 48, bias=True, method=Fp8LinearMethod(is_serialized=False))
    proj.weight.data.copy_(torch.randn(48, 64, generator=gen) / 8)
    proj.bias.data.copy_(torch.randn(48, generator=gen))
    proj.process_weights_after_loading()
    assert proj.takes_fp8_activations
    norm = RMSNorm(64, 1e-5, TORCH_OPS)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(64, generator=gen))
    x, residual = torch.randn(6, 64, generator=gen), torch.randn(6, 64, generator=gen)

    out, summed = triton_rms_norm_linear(x, residual.clone(), norm, proj)
    normed, ref_summed = norm(x, residual.clone())
    ref = proj(normed)
    torch.testing.assert_close(summed, ref_summed)
    torch.testing.assert_close(out, ref)

    gate_up = torch.randn(6, 128, generator=gen)
    out = triton_silu_mul_linear(gate_up, proj)
    ref = proj(torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:])
    torch.testing.assert_close(out, ref)
