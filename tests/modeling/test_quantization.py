"""Quantized linear methods: each scheme's layer against its dequantized reference, every checkpoint
packing read back to the weights it was made from, and the choice of scheme from flag and config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgi_compat.modeling.layers.linear import Linear, QKVLinear
from tgi_compat.modeling.layers.quantization.fp8 import Fp8LinearMethod
from tgi_compat.modeling.layers.quantization.int4 import Int4LinearMethod
from tgi_compat.modeling.layers.quantization.int8 import Int8LinearMethod
from tgi_compat.modeling.layers.quantization.select import QuantizationError, resolve_quantization

FP8 = torch.float8_e4m3fn


def _fake_fp8_per_row(t: torch.Tensor) -> torch.Tensor:
    """t rounded through e4m3 with one absmax scale per row (written independently of the methods)."""
    scale = t.abs().amax(dim=1, keepdim=True) / 448.0
    return (t / scale).to(FP8).float() * scale


def _loaded(layer, tensors: dict[str, object]):
    """Feed (param name -> tensor, or list of (shard, tensor)) through the layer's weight loaders."""
    params = dict(layer.named_parameters())
    for name, value in tensors.items():
        for shard, tensor in value if isinstance(value, list) else [(None, value)]:
            params[name].weight_loader(params[name], tensor, shard)
    layer.process_weights_after_loading()
    return layer


def test_fp8_on_the_fly_matches_fake_quantized_product():
    gen = torch.Generator().manual_seed(0)
    weight, bias, x = (
        torch.randn(48, 64, generator=gen),
        torch.randn(48, generator=gen),
        torch.randn(5, 64, generator=gen),
    )
    layer = _loaded(
        Linear(64, 48, bias=True, method=Fp8LinearMethod(is_serialized=False)), {"weight": weight, "bias": bias}
    )
    assert layer.gemv_weight is None  # emulated FP8 (no FP8 matmul here): fused GEMVs must not read it
    expected = F.linear(_fake_fp8_per_row(x), _fake_fp8_per_row(weight), bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    exact = F.linear(x, weight, bias)
    assert (layer(x) - exact).norm() / exact.norm() < 0.05  # FP8's error, not a broken layer


def test_fp8_checkpoint_per_tensor_scales_of_fused_shards():
    gen = torch.Generator().manual_seed(1)
    layer = QKVLinear(32, num_heads=2, num_kv_heads=1, head_dim=16, bias=False, method=Fp8LinearMethod(True))
    shards = {
        s: (torch.randn(rows, 32, generator=gen).to(FP8), torch.rand(1, generator=gen) + 0.5)
        for s, rows in (("q", 32), ("k", 16), ("v", 16))
    }
    weights, scales = [(s, w) for s, (w, _) in shards.items()], [(s, sc) for s, (_, sc) in shards.items()]
    _loaded(layer, {"weight": weights, "weight_scale": scales})
    dequantized = torch.cat([w.float() * sc for w, sc in shards.values()])
    x = torch.randn(3, 32, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(_fake_fp8_per_row(x), dequantized), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantize_activations", [False, True])
def test_int8_layer_matches_dequantized_reference(quantize_activations: bool):
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (40, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(40, 1, generator=gen) / 100  # compressed-tensors stores [out, 1]
    linear = Linear(64, 40, method=Int8LinearMethod(True, quantize_activations))
    layer = _loaded(linear, {"weight": q, "weight_scale": scale})
    x = torch.randn(4, 64, generator=gen)
    if quantize_activations:
        x_scale = x.abs().amax(1, keepdim=True) / 127
        x = (x / x_scale).round() * x_scale
    torch.testing.assert_close(layer(x), F.linear(x, q.float() * scale), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.gemv_weight.dequantize(), q.float() * scale)  # what the decode GEMV reads


def test_int8_on_the_fly_is_within_int8_error():
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(40, 64, generator=gen), torch.randn(4, 64, generator=gen)
    layer = _loaded(Linear(64, 40, method=Int8LinearMethod(False)), {"weight": weight})
    assert layer.weight.dtype == torch.int8
    exact = F.linear(x, weight)
    assert (layer(x) - exact).norm() / exact.norm() < 0.01


# --- int4: each checkpoint packing, written here from its format description -------------------


def _pack_rows_of_8(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[..., n] ints 0..15 -> int32 [..., n/8], nibble i holding element order[i] of each 8."""
    groups = values.reshape(*values.shape[:-1], -1, 8).to(torch.int64)
    packed = sum(groups[..., j] << (4 * i) for i, j in enumerate(order))
    return packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32)


def _int4_checkpoint(fmt: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [out, in], scale/zero [out, in/G] -> the format's tensors for one shard."""
    if fmt == "awq":
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        return {
            "qweight": _pack_rows_of_8(q.t(), order),
            "qzeros": _pack_rows_of_8(zero.t(), order),
            "scales": scale.t().half(),
        }
    if fmt == "gptq":  # v1 stores zero - 1; the weight packs 8 input rows per int32
        return {
            "qweight": _pack_rows_of_8(q).t(),
            "qzeros": _pack_rows_of_8(zero.t() - 1),
            "scales": scale.t().half(),
            "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // (q.shape[1] // scale.shape[1]),
        }
    return {"weight_packed": _pack_rows_of_8(q), "weight_scale": scale.half(), "weight_shape": torch.tensor(q.shape)}


@pytest.mark.parametrize("fmt", ["awq", "gptq", "pack-quantized"])
def test_int4_checkpoint_formats_load_to_the_weights_they_pack(fmt: str):
    gen = torch.Generator().manual_seed(4)
    group, hidden = 16, 64
    method = Int4LinearMethod(fmt, group, zero_offset=1.0 if fmt == "gptq" else 0.0)
    layer = QKVLinear(hidden, num_heads=2, num_kv_heads=1, head_dim=16, bias=False, method=method)
    tensors, dequantized = {}, []
    for shard, rows in (("q", 32), ("k", 16), ("v", 16)):
        q = torch.randint(0, 16, (rows, hidden), generator=gen)
        scale = (torch.rand(rows, hidden // group, generator=gen) / 10).half().float()
        zero = (
            torch.full_like(scale, 8) if fmt == "pack-quantized" else torch.randint(1, 16, scale.shape, generator=gen)
        )
        for name, tensor in _int4_checkpoint(fmt, q, scale, zero.int()).items():
            tensors.setdefault(name, []).append((shard, tensor))
        dequantized.append((q - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1))
    _loaded(layer, tensors)
    x = torch.randn(3, hidden, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat(dequantized)), rtol=1e-3, atol=1e-3)
    # the decode GEMV's reading of the stored layout (tgi_compat.kernels.gemv.gemv is tested against dequantize())
    torch.testing.assert_close(layer.gemv_weight.dequantize(), torch.cat(dequantized), rtol=1e-3, atol=1e-3)


def test_gptq_act_order_is_refused():
    layer = Linear(32, 8, method=Int4LinearMethod("gptq", 16, 1.0))
    q, scale = torch.randint(0, 16, (8, 32)), torch.rand(8, 2)
    tensors = _int4_checkpoint("gptq", q, scale, torch.full_like(scale, 8).int())
    tensors["g_idx"] = tensors["g_idx"].flip(0)
    with pytest.raises(ValueError, match="act-order"):
        _loaded(layer, tensors)


# --- which scheme runs ------------------------------------------------------------------------


def test_resolution_from_flag_and_checkpoint():
    assert resolve_quantization(None, None) is None
    assert resolve_quantization("fp8", None).linear_method().is_serialized is False
    assert resolve_quantization("eetq", None).name == "int8"
    fp8 = {"num_bits": 8, "type": "float"}
    group = {"weights": {**fp8, "strategy": "channel"}, "input_activations": {**fp8, "dynamic": True}}
    ct_fp8 = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"group_0": group}}
    method = resolve_quantization("fp8", ct_fp8).linear_method()
    assert method.is_serialized and not method.has_input_scale
    assert resolve_quantization(None, {"quant_method": "fp8", "activation_scheme": "static"}).has_input_scale
    awq = resolve_quantization(None, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"})
    assert awq.linear_method().format == "awq"


@pytest.mark.parametrize(
    "flag, checkpoint, message",
    [
        ("awq", None, "needs a checkpoint quantized with awq"),
        ("gptq", {"quant_method": "awq"}, "quantized with 'awq'"),
        (None, {"quant_method": "bitsandbytes"}, "not supported"),
        (None, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "act-order"),
    ],
)
def test_resolution_refusals(flag, checkpoint, message):
    with pytest.raises((QuantizationError, ValueError), match=message):
        resolve_quantization(flag, checkpoint)


def test_int4_round_to_nearest_while_loading():
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(24, 256, generator=gen), torch.randn(3, 256, generator=gen)
    layer = _loaded(Linear(256, 24, method=Int4LinearMethod("rtn", 128)), {"weight": weight})
    assert layer.qweight.shape == (24, 32) and layer.qweight.dtype == torch.int32 and layer.scales.shape == (24, 2)
    exact = F.linear(x, weight)
    assert (layer(x) - exact).norm() / exact.norm() < 0.12  # int4's error, not a broken layer
