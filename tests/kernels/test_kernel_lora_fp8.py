"""LoRA over an FP8 base, under the interpreter: A's rows quantized per row at staging (tgi_compat/modeling/lora/
folding.py). The folded projection's extra output columns are the FP8 GEMM of the per-token quantized activations
and the quantized A, each row by its scales; the segmented shrink reads the same e4m3 A and its scales (prefill-sized
steps); both against their float32 torch references."""

from __future__ import annotations

import torch

from tgi_compat.kernels.lora.shrink import lora_shrink, lora_shrink_ref
from tgi_compat.kernels.quant.per_token import quant_per_token_ref
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.quantization.base import layer_tensor
from tgi_compat.modeling.layers.quantization.fp8 import (
    FP8_DTYPE,
    Fp8LinearMethod,
    dequantize_fp8,
    quantize_weight_per_channel,
)
from tgi_compat.modeling.lora.adapter import LoraModule
from tgi_compat.modeling.lora.step import lora_step
from tgi_compat.modeling.lora.weights import LoraWeights

IN, OUT, MAX_LORAS, RANK = 64, 48, 2, 8  # 2 slots x 8 rows: 16 extra rows, on the FP8 GEMM's 16-column grid


def fp8_projection() -> Linear:
    """An FP8 checkpoint's projection as a GPU with FP8 tensor cores runs it (the interpreter runs its kernels)."""
    method = Fp8LinearMethod(is_serialized=True)
    proj = Linear(IN, OUT, method=method)
    weight, scale = quantize_weight_per_channel(torch.randn(OUT, IN))
    layer_tensor(proj, "weight").data.copy_(weight)
    layer_tensor(proj, "weight_scale").data.copy_(scale)
    method.use_scaled_mm = True  # (process_weights_after_loading says so on such a GPU)
    return proj


def staged_adapter(lora: LoraWeights, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    return lora.stage({"o_proj": LoraModule(torch.randn(RANK, IN) * 0.1, torch.randn(OUT, RANK) * 0.1)})


def test_an_fp8_projection_folds_a_quantized_per_row_into_its_gemm():
    proj = fp8_projection()
    x = torch.randn(5, IN, dtype=torch.bfloat16)
    before = proj(x)
    lora = LoraWeights(proj, ("o_proj",), MAX_LORAS, RANK)
    twin = lora.folded_for(5)
    assert twin is not None and lora.a.dtype == FP8_DTYPE and lora.a_scale is not None
    assert layer_tensor(proj, "weight_scale").data_ptr() == layer_tensor(twin, "weight_scale").data_ptr()
    assert torch.equal(proj(x), before)  # the plain path: the same weight, now a view of the twin's
    for slot in range(MAX_LORAS):
        staged = staged_adapter(lora, seed=slot)
        assert [t.dtype for t in staged] == [FP8_DTYPE, torch.float32, torch.float32]  # A, B, A's row scales
        lora.place(slot, staged)
    full = twin(x)
    assert torch.equal(full[:, :OUT], before)
    x_q, x_scale = quant_per_token_ref(x, FP8_DTYPE)
    a = dequantize_fp8(lora.a.reshape(-1, IN), lora.a_scale.reshape(-1))
    expected = (x_q.float() * x_scale) @ a.T
    torch.testing.assert_close(full[:, OUT:].float(), expected, rtol=2e-2, atol=2e-2)  # (a bf16 output)


def test_the_rounding_of_a_is_fp8s_per_row():
    proj = fp8_projection()
    lora = LoraWeights(proj, ("o_proj",), MAX_LORAS, RANK)
    a, _, scale = staged_adapter(lora, seed=0)
    torch.manual_seed(0)
    exact = torch.randn(RANK, IN) * 0.1
    restored = dequantize_fp8(a, scale)[:RANK]
    assert (restored - exact).abs().max() <= exact.abs().amax(1, keepdim=True).max() / 16  # e4m3: 3 mantissa bits
    assert torch.equal(a[RANK:].float(), torch.zeros(a.shape[0] - RANK, IN))  # past the rank: zero


def test_the_segmented_shrink_reads_an_fp8_a_with_its_row_scales():
    torch.manual_seed(3)
    a, scale = quantize_weight_per_channel(torch.randn(MAX_LORAS * 16, IN))
    a, scale = a.view(MAX_LORAS, 16, IN), scale.view(MAX_LORAS, 16)
    x = torch.randn(7, IN)  # float32, as every interpreter test: its bf16 dot does not compute bf16 products
    step = lora_step(torch.tensor([1, -1, 0, 1, 1, -1, 0]), MAX_LORAS)
    out = lora_shrink(x, a, step, a_scale=scale).rows()
    ref = lora_shrink_ref(x, a, step, a_scale=scale).rows()
    lora_rows = int(step.seg_len.sum())
    torch.testing.assert_close(out[:lora_rows], ref[:lora_rows], rtol=1e-4, atol=1e-4)
    unscaled = lora_shrink_ref(x, a, step).rows()
    assert not torch.allclose(unscaled[:lora_rows], ref[:lora_rows])  # the scales matter
