"""GPU (marker `gpu`; skipped without CUDA): LLaVA-Next, Idefics3, Idefics2 and PaliGemma 1 and 2 through the
transformers fallback in the real engine on the device (Triton attention backend under transformers' text model, its
vision tower with sdpa): fp32 greedy ids equal transformers' (on the CPU) with two images beside a text request, whole
and under 7-token prefill chunks (Idefics3's rows fill only its `<image>`s between row/column tokens, Idefics2's
between fake tokens: PromptImage.embeds; PaliGemma's whole prompt attends both ways, through the torch attention
reference).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_llava_next_gpu.py   (under 1 min)
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from benchmarks.device.steps import engine_tokens
from tests.modeling import idefics2_helpers, idefics3_helpers, llava_next_helpers, paligemma_helpers
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
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_on_the_device_equal_transformers(tmp_path, prefill, family):
    saved, check = FAMILIES[family]
    model, folder = saved(tmp_path)
    config = EngineConfig(model_id=folder, device="cuda", dtype="float32", max_batch_prefill_tokens=prefill)
    engine = EngineCore.from_config(config)
    assert engine.executor.batch_builder.images is not None  # the image path, not text only
    check(model, lambda requests: engine_tokens(engine, requests))
