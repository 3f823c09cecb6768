"""GPU (marker `gpu`; skipped without CUDA): InternLM2 and the pooling models on the device, Triton backend and layer
ops, in float32 against their CPU references: InternLM2's prefill logits, then one-token decodes replayed from the
CUDA graphs; InternLM2's reward (`v_head`) and a Qwen2 classifier's scores pooled from one flat step of prompts of
different lengths.

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_internlm2_pooling_gpu.py   (< 1 min)
"""

from __future__ import annotations

import pytest
import torch

from tests.modeling.helpers import max_rel_error, run_step
from tests.modeling.internlm2_reference import REWARD_TOKEN_ID, InternLM2Reference
from tests.modeling.pooling_models import hf_pooled, tiny_model
from tests.modeling.test_pooling_parity import pool_step, prompts
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"  # a module knob, so that the CPU can walk the same path (`DEVICE = "cpu"`)
SIZES = dict(hidden_size=128, intermediate_size=256)  # head_dim 32: the Triton attention's smallest
TOLERANCE = 2e-3  # relative to the largest value: the kernels' reduction order differs from torch's
PROMPT = [1, 17, 200, 33, 91, 4, 150, 12, 9]


def _runner(folder: str) -> ModelRunner:
    config = RunnerConfig(
        model_id=folder,
        device=DEVICE,
        dtype="float32",
        num_kv_slots=512,
        max_rows=4,
        cuda_graph_batch_sizes=[1, 2, 4],
        show_progress=False,
    )
    return ModelRunner(config)


def test_internlm2_prefill_and_graph_decodes_equal_the_reference(tmp_path):
    reference = InternLM2Reference(**SIZES)
    reference.save(str(tmp_path))
    runner = _runner(str(tmp_path))
    ids = list(PROMPT)
    [logits] = run_step(runner, [(0, ids, 0, list(range(len(ids))))])
    assert max_rel_error(logits.float().cpu(), reference.logits(ids)) <= TOLERANCE
    for _ in range(4):  # one-token steps of one row: replayed from the decode graphs
        ids.append(int(logits[-1].argmax()))
        [logits] = run_step(runner, [(0, ids[-1:], len(ids) - 1, [len(ids) - 1])])
        assert max_rel_error(logits[-1].float().cpu(), reference.logits(ids)[-1]) <= TOLERANCE


def _internlm2_reward(folder: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    reference = InternLM2Reference(reward=True, **SIZES)
    reference.save(folder)
    batch = [p + [REWARD_TOKEN_ID] for p in prompts(256)]
    return batch, [reference.reward(p) for p in batch]


def _qwen2_classifier(folder: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    model = tiny_model("Qwen2ForSequenceClassification", "Qwen2Config", num_labels=3, pad_token_id=0, **SIZES)
    model.save_pretrained(folder)
    batch = prompts(256)
    return batch, [hf_pooled(model, p) for p in batch]


@pytest.mark.parametrize("make", [_internlm2_reward, _qwen2_classifier], ids=["internlm2-reward", "qwen2-classify"])
def test_pooled_outputs_on_the_device_equal_the_references(make, tmp_path):
    batch, expected = make(str(tmp_path))
    ours = pool_step(_runner(str(tmp_path)), batch).cpu()
    assert max_rel_error(ours, torch.stack(expected)) <= TOLERANCE
