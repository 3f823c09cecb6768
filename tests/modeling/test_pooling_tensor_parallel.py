"""Pooling models under tensor parallelism on CPU (gloo, 2 ranks): the sharded decoder's pooled outputs (a
classifier's scores, Qwen2.5-Math-RM's and InternLM2's rewards, a mean-pooled embedding) equal one rank's within 1e-4 (fp32). Rank 0 drives
`ModelRunner.pool`, which broadcasts each step; the other rank follows it (tests/modeling/tp_group.py). Uneven
sizes (6 query heads over 3 KV heads, 100 intermediate rows, a vocabulary of 251) split unevenly somewhere."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from tests.modeling.internlm2_reference import InternLM2Reference
from tests.modeling.pooling_models import RewardModel, save_sentence_transformers_pooling, tiny_model
from tests.modeling.test_pooling_parity import pool_step, prompts
from tests.modeling.test_tensor_parallel_logits import SHARDED_SIZES, _runner
from tests.modeling.tp_group import saved_models, sharded_results
from tgi_compat.modeling.parallel import NO_TP
from tgi_compat.modeling.runner import ModelRunner

SIZES = {**SHARDED_SIZES, "vocab_size": 251}


def pool_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Two steps: four prompts of different lengths together, then one alone."""
    batch = prompts(runner.vocab_size)
    return [pool_step(runner, batch).clone(), pool_step(runner, batch[1:2]).clone()]


def _save_classifier(folder: str, sizes: dict) -> None:
    tiny_model("Qwen2ForSequenceClassification", "Qwen2Config", num_labels=3, pad_token_id=0, **sizes).save_pretrained(
        folder
    )


def _save_embedder(folder: str, sizes: dict) -> None:
    tiny_model("LlamaModel", "LlamaConfig", **sizes).save_pretrained(folder)
    save_sentence_transformers_pooling(folder, "mean_tokens", normalize=True)  # every token's hidden state


def _save_internlm2_reward(folder: str, sizes: dict) -> None:
    InternLM2Reference(reward=True, **sizes).save(folder)


# name -> its tiny checkpoint's writer (folder, sizes); tests/gpu/check_tp_families.py runs them on 2 GPUs too
MODELS: dict[str, Callable[[str, dict], None]] = {
    "classify": _save_classifier,
    "reward": lambda folder, sizes: RewardModel(**sizes).save(folder),
    "embed": _save_embedder,
    # q|k|v packed per KV head (wqkv): unpacked, then split by head; its v_head replicated
    "internlm2-reward": _save_internlm2_reward,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return saved_models(tmp_path_factory, MODELS, SIZES, "tp")


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory) -> dict[str, list[torch.Tensor]]:
    """folder -> rank 0's pooled outputs of every step, from one group of 2 ranks that serves each model in turn."""
    runs = {folder: (folder, pool_steps) for folder in folders.values()}
    return sharded_results(2, runs, _runner, str(tmp_path_factory.mktemp("tp-pool") / "pooled.pt"))


@functools.cache
def _one_rank(folder: str) -> list[torch.Tensor]:
    return pool_steps(_runner(folder, NO_TP))


@pytest.mark.parametrize("model", list(MODELS))
def test_sharded_pooling_equals_one_rank(model, folders, sharded):
    folder = folders[model]
    for ours, reference in zip(sharded[folder], _one_rank(folder), strict=True):
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max().item() <= 1e-4
