"""Gemma 3 with images on the Triton backend (interpreted): a step whose image placeholders attend to each
other both ways attends through the torch reference, the rest of the step and the decodes stay on the kernels;
logits equal transformers' within 1e-3 (fp32), the prompt's chunks, then decode steps over it."""

from __future__ import annotations

import torch

from tests.modeling.helpers import max_rel_error
from tests.modeling.test_gemma3_multimodal import tiny_multimodal
from tests.modeling.test_gemma3_vision import VOCAB, pixels, prompt, reference_logits, run, text
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig


def test_images_on_the_triton_backend_equal_transformers(tmp_path):
    model = tiny_multimodal(VOCAB)
    model.save_pretrained(tmp_path)
    config = RunnerConfig(
        model_id=str(tmp_path), device="cpu", dtype="float32", attention_backend="triton", num_kv_slots=256,
        max_rows=4, show_progress=False,
    )  # fmt: skip
    runner = ModelRunner(config)
    pixel_values = pixels((200, 30, 60), (10, 220, 90))
    ids = prompt(text(1, 5), text(2, 6), text(3, 4))
    features = runner.model.encode_images(pixel_values)
    slots = list(range(10, 10 + len(ids)))
    ref = reference_logits(model, ids, pixel_values)
    cut = len(ids) - 3
    chunks = [run(runner, ids[:cut], 0, slots, features)]  # both images, bidirectional
    chunks += [run(runner, ids[: p + 1], p, slots, features) for p in range(cut, len(ids))]  # decode steps
    assert runner.backend.image_step is None  # the last steps had no image
    assert max_rel_error(torch.cat(chunks), ref) <= 1e-3
