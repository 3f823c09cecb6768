"""GPU (marker `gpu`; skipped without CUDA): the Qwen2.5-VL vision encoder's attention backends (VISION_ATTENTION:
the Triton varlen kernel, torch's FlashAttention varlen, sdpa per length group) at the 7B's vision shape (16 heads x
80, 1024x1024 and 448x672 images' windows and whole images) against the fp32 reference; the encoder on each backend
and each elementwise choice (transformers' modules, the fused Triton norms and rotary) against transformers' own
vision transformer on the same random weights; and its forward from a host grid with no
device-to-host sync (the split sizes come from the host grid, not from reading the device back).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_vision_attention_gpu.py   (~2 min)
"""

from __future__ import annotations

import warnings

import pytest
import torch

from benchmarks.device.qwen_vl import VISION_7B
from tests.gpu.test_qwen2_5_vl_gpu import GRIDS_7B, relative_error
from tgi_compat.modeling.dtypes import default_dtype
from tgi_compat.modeling.vision.qwen2_5_vl import QWEN2_5_VL, QwenVLVisionEncoder, WindowLayout
from tgi_compat.modeling.vision.qwen_vl_ops import SDPA, VISION_ATTENTION, VISION_ELEMENTWISE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", sorted(VISION_ATTENTION))
def test_backend_at_the_7b_vision_shape(backend, dtype):
    """FlashAttention in fp32 falls back to the Triton kernel (it has no fp32 kernel)."""
    from transformers import Qwen2_5_VLConfig

    grid = torch.tensor(GRIDS_7B)
    layout = WindowLayout.of(grid, Qwen2_5_VLConfig(vision_config=VISION_7B).vision_config, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(int(grid.prod(-1).sum()), 3, 16, 80, device="cuda", generator=gen).to(dtype)
    q, k, v = qkv.unbind(1)  # strided views, as the encoder's fused projection gives them
    for spans in (layout.windows, layout.images):
        out = VISION_ATTENTION[backend].attend(q.contiguous(), k.contiguous(), v, spans, 80**-0.5)
        ref = SDPA.attend(q.float(), k.float(), v.float(), spans, 80**-0.5)
        assert out.dtype == dtype
        assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (backend, spans.longest)


@pytest.fixture(scope="module")
def encoder_7b():
    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):  # as the runner builds it
        return QwenVLVisionEncoder({"vision_config": VISION_7B}, QWEN2_5_VL).eval()


def inputs(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda", generator=gen)
    return pixels.to(torch.bfloat16), grid


@pytest.mark.parametrize("elementwise", sorted(VISION_ELEMENTWISE))
@pytest.mark.parametrize("backend", sorted(VISION_ATTENTION))
def test_encoder_on_each_choice_equals_transformers(backend, elementwise):
    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):  # as the runner builds it
        encoder = QwenVLVisionEncoder(
            {"vision_config": VISION_7B}, QWEN2_5_VL, VISION_ATTENTION[backend], VISION_ELEMENTWISE[elementwise]
        ).eval()
    pixels, grid = inputs(torch.tensor(GRIDS_7B, device="cuda"))
    rows = encoder({"pixel_values": pixels, "image_grid_thw": grid})
    with torch.inference_mode():
        expected = encoder.visual(pixels, grid_thw=grid).pooler_output
    assert relative_error(torch.cat(rows), expected) < 3e-2, (backend, elementwise)


def test_forward_from_a_host_grid_never_syncs(encoder_7b):
    pixels, grid = inputs(torch.tensor(GRIDS_7B))
    encoder_7b({"pixel_values": pixels, "image_grid_thw": grid})  # warm: kernels compiled, allocator grown
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rows = encoder_7b({"pixel_values": pixels, "image_grid_thw": grid})
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [r.shape[0] for r in rows] == [37 * 37, 16 * 24]
    # (torch's one-off notice that the debug mode is a prototype is no sync: it comes with the first test to use it)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
    assert not syncs
