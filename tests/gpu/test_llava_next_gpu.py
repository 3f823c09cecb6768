"""GPU (marker `gpu`; skipped without CUDA): LLaVA-Next, Idefics3, Idefics2, PaliGemma 1 and 2 and Mllama through
the transformers fallback in the real engine on the device (Triton attention backend under transformers' text model,
its vision tower with sdpa): fp32 greedy ids equal transformers' (on the CPU) with two images beside a text request,
whole and under 7-token prefill chunks (Idefics3's rows fill only its `<image>`s between row/column tokens, Idefics2's
between fake tokens: PromptImage.embeds; PaliGemma's whole prompt attends both ways, through the torch attention
reference; Mllama's text cross-attends to its images' keys, tgi_compat/router/cross_attention.py).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_llava_next_gpu.py   (under 1 min)
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from benchmarks.device.steps import engine_tokens
from tests.modeling import idefics2_helpers, idefics3_helpers, llava_next_helpers, mllama_helpers, paligemma_helpers
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# each family's (checkpoint writer, check)
FAMILIES = {
    "llava_next": (llava_next_helpers.saved_llava_next, llava_next_helpers.check_images_beside_text),
    "idefics3": (idefics3_helpers.saved_idefics3, idefics3_helpers.check_images_beside_text),
    "idefics2": (idefics2_helpers.saved_idefics2, idefics2_helpers.check_images_beside_text),
    "paligemma": (paligemma_helpers.saved_paligemma, paligemma_helpers.check_images_beside_text),
    "paligemma2": (
        partial(paligemma_helpers.saved_paligemma, model_type="gemma2"),
        paligemma_helpers.check_images_beside_text,
    ),
    "mllama": (mllama_helpers.saved_mllama, mllama_helpers.check_images_beside_text),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_on_the_device_equal_transformers(tmp_path, prefill, family):
    saved, check = FAMILIES[family]
    model, folder = saved(tmp_path)
    config = EngineConfig(model_id=folder, device="cuda", dtype="float32", max_batch_prefill_tokens=prefill)
    engine = EngineCore.from_config(config)
    builder = engine.executor.batch_builder
    assert builder.images is not None or builder.cross is not None  # the image path, not text only
    check(model, lambda requests: engine_tokens(engine, requests))


def test_mllama_image_keys_get_room_beside_the_kv_cache(tmp_path):
    """The KV cache sized from the free memory leaves a share to the image keys, which bounds the running images."""
    from tgi_compat.modeling.vision.cross_keys import CROSS_KEYS_SHARE

    _, folder = mllama_helpers.saved_mllama(tmp_path)
    engine = EngineCore.from_config(EngineConfig(model_id=folder, device="cuda", dtype="float32"))
    bound = engine.scheduler.limits.max_cross_images
    assert bound is not None and bound >= 1 and CROSS_KEYS_SHARE < 1
