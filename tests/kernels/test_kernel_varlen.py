"""The non-causal varlen attention (the extend kernel's CAUSAL=False mode over packed sequences) against its
sdpa reference (one call per sequence length), at Qwen2.5-VL's vision head size 80 (not a power of two); and the Qwen2.5-VL vision
encoder with it in place of the reference, against transformers' own vision transformer (fp32)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks.device.vision_encoder import TILES
from tests.kernels.test_kernel_attention import relative_error
from tests.modeling.helpers import max_rel_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_attention_matches_reference(dtype):
    varlen = sys.modules["tgi_compat.kernels.attention.varlen"]  # the interpreted module conftest.py loaded
    gen = torch.Generator().manual_seed(3)
    lens = [16, 5, 40, 1, 16]  # whole windows, windows cut at an image's edge, a sequence past one key block
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(sum(lens), 3, 2, 80, generator=gen).to(dtype)
    q, k, v = qkv.unbind(1)  # strided views, as the encoder's fused projection gives them
    out = varlen.varlen_attention(q.contiguous(), k, v, cu, max(lens), 80**-0.5)
    ref = varlen.varlen_attention_ref(q.float(), k.float(), v.float(), cu, 80**-0.5)
    assert out.dtype == dtype
    assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


def test_qwen2_5_vl_encoder_on_the_kernel_equals_transformers():
    from tests.modeling import test_qwen2_5_vl_encoder as encoder_test
    from tgi_compat.modeling.vision.qwen_vl_ops import VisionAttention

    varlen = sys.modules["tgi_compat.kernels.attention.varlen"]
    calls = []

    def on_the_kernel(q, k, v, spans, scale):
        calls.append(len(spans.cu_seqlens) - 1)
        return varlen.varlen_attention(q, k, v, spans.cu_seqlens, spans.longest, scale)

    reference, encoder = encoder_test.encoder_pair()
    # the TRITON path, on CPU, for windows and whole images alike
    encoder.backend = encoder.full_backend = VisionAttention("triton-interpreted", on_the_kernel, on_cpu=True)
    inputs = encoder_test.processed(encoder_test.IMAGES)
    with torch.no_grad():
        expected = reference(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    assert max_rel_error(torch.cat(encoder(dict(inputs))), expected) < 1e-3
    assert calls == [6 + 2 + 4, 3]  # one call a layer: the windows of all three images, then the images


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_qwen_vl_encoder_on_the_fused_elementwise_kernels_equals_transformers(family, monkeypatch):
    """The Triton RMSNorm + residual, in-place rotary and roped window attention (interpreted) in the encoder's
    forward: transformers' own output. Qwen2.5-VL's window blocks take the window kernel and its full blocks the
    rotary; Qwen2-VL's LayerNorm tower keeps transformers' modules."""
    import dataclasses

    from tests.modeling import test_qwen2_5_vl_encoder as encoder_test
    from tgi_compat.modeling.vision.qwen_vl_ops import TRITON_ELEMENTWISE

    calls = []

    def counted_rotary(q, k, tables):
        calls.append("rotary")
        return TRITON_ELEMENTWISE.rotary(q, k, tables)

    def counted_windows(qkv, tables, spans, scale):
        calls.append("windows")
        assert tables[0].shape[-1] == qkv.shape[-1] // 2  # the half tables
        return TRITON_ELEMENTWISE.windows(qkv, tables, spans, scale)

    from tgi_compat.modeling.vision import qwen2_5_vl

    reference, encoder = encoder_test.encoder_pair(family)
    inputs = encoder_test.processed(encoder_test.IMAGES)
    if encoder.windowed:  # the test's images are small: the kernel takes their windows alone, as a 1024px image's
        grid, config = inputs["image_grid_thw"], encoder.visual.config
        layout = qwen2_5_vl.WindowLayout.of(grid, config, torch.device("cpu"))
        monkeypatch.setattr(qwen2_5_vl, "WINDOW_TOKENS", layout.windows.longest)
        assert layout.images.longest > layout.windows.longest
    # the CUDA path, on CPU
    encoder.elementwise = dataclasses.replace(
        TRITON_ELEMENTWISE, on_cpu=True, rotary=counted_rotary, windows=counted_windows
    )
    with torch.no_grad():
        expected = reference(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    assert max_rel_error(torch.cat(encoder(dict(inputs))), expected) < 1e-3
    if family == "qwen2_vl":
        assert calls == []
    else:
        full = encoder.full_blocks
        assert calls == ["rotary" if i in full else "windows" for i in range(len(encoder.visual.blocks))]
        assert full and len(full) < len(encoder.visual.blocks)


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "-".join(map(str, t)))
def test_varlen_attention_at_the_swept_tiles(tiles):
    """The tiles benchmarks/device/vision_encoder.py sweeps (block_m, block_n, warps, stages) give the reference's
    output (and, under benchmarks.compile_only, compile for sm_90)."""
    varlen = sys.modules["tgi_compat.kernels.attention.varlen"]
    gen = torch.Generator().manual_seed(4)
    lens = [64, 16, 130]  # a window, an edge window, a sequence past one tile of each size
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = torch.randn(sum(lens), 3, 2, 80, generator=gen).to(torch.float16).unbind(1)
    out = varlen.varlen_attention(q.contiguous(), k, v, cu, max(lens), 80**-0.5, *tiles)
    ref = varlen.varlen_attention_ref(q.float(), k.float(), v.float(), cu, 80**-0.5)
    assert relative_error(out, ref) < 5e-3
