"""Qwen2.5-VL on the Triton backend and the Triton layer ops (interpreted): the M-RoPE rows of a step (t, h, w
sections gathered once, layers/mrope.py) go through the same rotary kernels, prefill and the fused decode rotary
and KV store, unchanged; logits of the prompt's chunks and of decode steps past it (position + rope delta) equal
transformers' within 1e-3 (fp32), with two images of different grids."""

from __future__ import annotations

import sys

import torch

from tests.modeling.helpers import max_rel_error
from tests.modeling.qwen2_5_vl_helpers import reference_logits, saved_qwen2_5_vl
from tests.modeling.test_qwen2_5_vl import VOCAB, grids, processed, prompt, run, text
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.router.mrope import prompt_mrope


def test_mrope_on_the_triton_kernels_equals_transformers(tmp_path, monkeypatch):
    import tgi_compat.modeling.runner

    triton_ops = sys.modules["tgi_compat.modeling.layers.triton_ops"]  # the interpreted module tests/kernels loaded
    monkeypatch.setattr(tgi_compat.modeling.runner, "select_ops", lambda device: triton_ops.TRITON_OPS)
    monkeypatch.setattr(triton_ops, "gemv_config_for", lambda *args: None)  # the GEMVs stay on the GPU
    model = saved_qwen2_5_vl(tmp_path, VOCAB)
    config = RunnerConfig(
        model_id=str(tmp_path), device="cpu", dtype="float32", attention_backend="triton", num_kv_slots=256,
        max_rows=4, show_progress=False,
    )  # fmt: skip
    runner = ModelRunner(config)
    assert runner.model.model.rotary_emb.ops is triton_ops.TRITON_OPS
    inputs = processed(2)
    ids, images = prompt(grids(inputs), text(1, 4), text(2, 3), text(3, 3))
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None
    features = runner.model.encode_processed(dict(inputs))
    full = ids + text(4, 3)  # three more tokens decoded one by one past the prompt
    ref = reference_logits(model, full, inputs)
    slots = list(range(10, 10 + len(full)))
    cut = images[-1].offset + 2  # a chunk ending inside the second image
    chunks = [run(runner, full[:cut], 0, slots, features, mrope), run(runner, ids, cut, slots, features, mrope)]
    chunks += [run(runner, full[: p + 1], p, slots, features, mrope) for p in range(len(ids), len(full))]
    assert max_rel_error(torch.cat(chunks), ref) <= 1e-3
