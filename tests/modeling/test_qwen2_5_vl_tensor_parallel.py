"""Images under tensor parallelism on CPU (gloo, 2 ranks): rank 0 sends each step's image rows, their bidirectional
spans (Gemma 3) and M-RoPE positions (Qwen2.5-VL, Qwen2-VL) through StepBroadcast; the sharded logits of a prefill
with two images, a chunk over its cached prefix and a decode step past the prompt equal one rank's, for the three
models."""

from __future__ import annotations

import torch

from tests.modeling.helpers import max_rel_error
from tests.modeling.qwen2_5_vl_helpers import FAMILIES, saved_qwen2_5_vl
from tests.modeling.test_qwen2_5_vl import VOCAB, grids, processed, prompt, run, text
from tests.modeling.tp_group import sharded_results
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.router.mrope import prompt_mrope


def _runner(folder: str, tp: TensorParallel) -> ModelRunner:
    config = RunnerConfig(model_id=folder, device="cpu", dtype="float32", num_kv_slots=128, max_rows=4)
    config.show_progress = False
    return ModelRunner(config, tp=tp)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    inputs = processed(2)
    ids, images = prompt(grids(inputs), text(1, 4), text(2, 3), text(3, 3))
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None
    features = runner.model.encode_processed(dict(inputs))
    full = ids + [17]
    slots = list(range(len(full)))
    cut = images[-1].offset + 2  # the second chunk starts inside the last image
    return [
        run(runner, full[:cut], 0, slots, features, mrope).clone(),
        run(runner, ids, cut, slots, features, mrope).clone(),
        run(runner, full, len(ids), slots, features, mrope).clone(),  # a decode: position + rope delta
    ]


def _gemma_steps(runner: ModelRunner) -> list[torch.Tensor]:
    from tests.modeling import test_gemma3_vision as gemma

    pixel_values = gemma.pixels((200, 30, 60), (10, 220, 90))
    ids = gemma.prompt(gemma.text(1, 5), gemma.text(2, 6), gemma.text(3, 4))
    features = runner.model.encode_images(pixel_values)
    slots = list(range(len(ids)))
    cut = len(ids) - 3
    return [
        gemma.run(runner, ids[:cut], 0, slots, features).clone(),  # both images, bidirectional spans
        gemma.run(runner, ids, cut, slots, features).clone(),
    ]


STEPS = {"qwen2_5_vl": _steps, "qwen2_vl": _steps, "gemma3": _gemma_steps}


def test_sharded_logits_with_images_equal_one_rank(tmp_path):
    from tests.modeling.test_gemma3_multimodal import tiny_multimodal
    from tests.modeling.test_gemma3_vision import VOCAB as GEMMA_VOCAB

    folders = {kind: str(tmp_path / kind) for kind in STEPS}
    for family in FAMILIES:
        saved_qwen2_5_vl(folders[family], VOCAB, family)
    tiny_multimodal(GEMMA_VOCAB).save_pretrained(folders["gemma3"])
    runs = {kind: (folder, STEPS[kind]) for kind, folder in folders.items()}
    sharded = sharded_results(2, runs, _runner, str(tmp_path / "logits.pt"), images=True)
    for kind, folder in folders.items():
        for ours, one in zip(sharded[kind], STEPS[kind](_runner(folder, NO_TP)), strict=True):
            assert max_rel_error(ours, one) <= 1e-4, kind
