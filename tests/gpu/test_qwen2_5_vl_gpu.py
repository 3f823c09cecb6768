"""GPU (marker `gpu`; skipped without CUDA): Qwen2.5-VL through the real engine on the device, Triton backend and
layer ops, decode CUDA graphs (an M-RoPE model's replay with the step's t/h/w rows): fp32 greedy ids equal
transformers' (on the CPU) with two images, whole and chunked prefill, overlap on and off, beside a text request;
decode steps with a rope delta replay the graphs.

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_qwen2_5_vl_gpu.py   (about 1 min)
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.device.steps import engine_tokens
from tests.modeling.qwen2_5_vl_helpers import ENGINE_VOCAB, check_two_images_beside_text, saved_qwen2_5_vl
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.model_loading import load_runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl-gpu")
    return saved_qwen2_5_vl(folder, ENGINE_VOCAB), str(folder)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_on_the_device_equal_transformers(checkpoint, prefill, overlap):
    model, folder = checkpoint
    config = EngineConfig(
        model_id=folder,
        device="cuda",
        dtype="float32",
        max_batch_total_tokens=1024,
        max_batch_prefill_tokens=prefill,
        overlap_scheduling=overlap,
    )
    runner = load_runner(config)
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.mrope
    replayed = []

    def counted(batch, replay=graphs.replay):
        replayed.append(batch.rope_positions is not None)
        return replay(batch)

    graphs.replay = counted  # type: ignore[method-assign]
    engine = EngineCore(config, runner, runner.model_config, runner.lora, runner.image_encoder)
    check_two_images_beside_text(model, lambda requests: engine_tokens(engine, requests))
    assert any(replayed)  # decodes of the image request, position + rope delta, through the graphs
