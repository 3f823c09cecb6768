"""Logits parity with transformers on tiny random models of every supported architecture,
loaded through our safetensors path (single file and sharded with an index)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from tests.modeling.helpers import full_logits, hf_logits, max_rel_error, runner_for_folder, tiny_hf_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama": (LlamaConfig, {}),
    "llama-mha-tied": (LlamaConfig, {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": (LlamaConfig, {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}),
    "llama-linear-rope": (
        LlamaConfig,
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "llama-attention-mlp-bias": (LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "mistral-window": (MistralConfig, {"sliding_window": 16}),  # the 40-token prompt passes the window
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 32}),
}


def prompt(vocab_size: int, length: int = 40, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, sharded, tmp_path):
    config_cls, overrides = CASES[case]
    model = tiny_hf_model(config_cls, **overrides)
    model.save_pretrained(tmp_path, max_shard_size="50KB" if sharded else "1GB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == sharded

    ids = prompt(model.config.vocab_size)
    ours = full_logits(runner_for_folder(str(tmp_path)), ids)
    assert max_rel_error(ours, hf_logits(model, ids)) <= 1e-4


def test_transformers4_style_config_is_read(tmp_path):
    """Older config.json files keep rope_theta top-level and call the scaling `rope_scaling`."""
    model = tiny_hf_model(LlamaConfig, rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
    (tmp_path / "config.json").write_text(json.dumps(config))

    ids = prompt(model.config.vocab_size)
    ours = full_logits(runner_for_folder(str(tmp_path)), ids)
    assert max_rel_error(ours, hf_logits(model, ids)) <= 1e-4
