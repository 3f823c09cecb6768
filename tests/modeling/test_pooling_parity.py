"""Pooling models against transformers on tiny random checkpoints (fp32, within 1e-4): classification heads
(last non-padding token), Qwen2.5-Math-RM's reward head, and bare decoders as embedding models pooled as their
sentence-transformers files say. Prompts of different lengths share one flat step."""

from __future__ import annotations

import pytest
import torch

from tests.modeling.helpers import runner_for_folder
from tests.modeling.pooling_models import RewardModel, hf_pooled, save_sentence_transformers_pooling, tiny_model
from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.modeling.runner import ModelRunner

PAD = 0


def prompts(vocab_size: int, lengths=(7, 19, 1, 12)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def pool_step(runner: ModelRunner, batch_prompts: list[list[int]]) -> torch.Tensor:
    """One EXTEND step over every prompt (rows 0..B-1, slots from 0): [B, output]."""
    lens = [len(p) for p in batch_prompts]
    ids = [t for p in batch_prompts for t in p]
    batch = build_forward_batch(ids, list(range(len(lens))), lens, lens, list(range(len(ids))), [], runner.device)
    return runner.pool(batch)


def assert_close(ours: torch.Tensor, reference: list[torch.Tensor]) -> None:
    expected = torch.stack(reference)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    ("class_name", "config_name", "extra"),
    [
        ("LlamaForSequenceClassification", "LlamaConfig", {}),
        ("Qwen2ForSequenceClassification", "Qwen2Config", {}),
        ("Qwen3ForSequenceClassification", "Qwen3Config", {"head_dim": 32}),
    ],
)
def test_classification_scores_match_transformers(class_name, config_name, extra, tmp_path):
    model = tiny_model(class_name, config_name, num_labels=3, pad_token_id=PAD, **extra)
    model.save_pretrained(tmp_path)
    batch_prompts = prompts(model.config.vocab_size)
    batch_prompts[1] = batch_prompts[1] + [PAD, PAD]  # right padding: the head reads the last real token
    batch_prompts[3] = [PAD, PAD] + batch_prompts[3]  # left padding
    ours = pool_step(runner_for_folder(str(tmp_path)), batch_prompts)
    assert_close(ours, [hf_pooled(model, p) for p in batch_prompts])


def test_classification_without_pad_id_reads_the_last_token(tmp_path):
    model = tiny_model("LlamaForSequenceClassification", "LlamaConfig", num_labels=1, pad_token_id=None)
    model.save_pretrained(tmp_path)
    batch_prompts = prompts(model.config.vocab_size)
    ours = pool_step(runner_for_folder(str(tmp_path)), batch_prompts)
    assert_close(ours, [hf_pooled(model, p) for p in batch_prompts])


def test_reward_model_matches_its_head(tmp_path):
    model = RewardModel()
    model.save(str(tmp_path))
    batch_prompts = prompts(model.config.vocab_size)
    ours = pool_step(runner_for_folder(str(tmp_path)), batch_prompts)
    assert_close(ours, [hf_pooled(model, p) for p in batch_prompts])


@pytest.mark.parametrize(
    ("config_name", "mode", "pooling", "normalize"),
    [
        ("LlamaConfig", "mean_tokens", "mean", True),
        ("Qwen2Config", "lasttoken", "last", True),
        ("Qwen3Config", "cls_token", "cls", False),
    ],
)
def test_embeddings_pool_as_sentence_transformers_says(config_name, mode, pooling, normalize, tmp_path):
    extra = {"head_dim": 32} if config_name == "Qwen3Config" else {}
    model = tiny_model(config_name.replace("Config", "Model"), config_name, **extra)
    model.save_pretrained(tmp_path)  # a bare decoder: tensor names without "model."
    save_sentence_transformers_pooling(str(tmp_path), mode, normalize)
    batch_prompts = prompts(model.config.vocab_size)
    ours = pool_step(runner_for_folder(str(tmp_path)), batch_prompts)
    assert_close(ours, [hf_pooled(model, p, pooling, normalize) for p in batch_prompts])


def test_embedding_model_without_sentence_transformers_files_takes_the_normalized_last_token(tmp_path):
    model = tiny_model("LlamaModel", "LlamaConfig")
    model.save_pretrained(tmp_path)
    batch_prompts = prompts(model.config.vocab_size)
    ours = pool_step(runner_for_folder(str(tmp_path)), batch_prompts)
    assert_close(ours, [hf_pooled(model, p, "last", normalize=True) for p in batch_prompts])


def test_generation_runner_refuses_to_pool(tmp_path):
    model = tiny_model("LlamaForCausalLM", "LlamaConfig")
    model.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="not a pooling model"):
        pool_step(runner_for_folder(str(tmp_path)), [[1, 2, 3]])
