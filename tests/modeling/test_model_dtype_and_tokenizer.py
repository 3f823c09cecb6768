"""bfloat16 on CPU, and the tokenizer bundle the API layer reads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig

from tests.modeling.helpers import full_logits, hf_logits, smollm2_gguf_path, tiny_hf_model
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.modeling.tokenizer import gguf_tokenizer_cache_folder, load_tokenizer_info


def test_bfloat16_runs_on_cpu_and_stays_close(tmp_path):
    model = tiny_hf_model(LlamaConfig)
    model.save_pretrained(tmp_path)
    runner = ModelRunner(
        RunnerConfig(
            model_id=str(tmp_path), device="cpu", dtype="bfloat16", num_kv_slots=512, max_rows=2, show_progress=False
        )
    )
    assert runner.dtype == torch.bfloat16 and runner.kv_caches[0][0].dtype == torch.bfloat16
    ids = list(range(3, 40))
    ours, ref = full_logits(runner, ids), hf_logits(model, ids)
    assert ours.dtype == torch.bfloat16  # the model's dtype: the sampler widens them where it processes them
    # bf16 keeps ~3 significant digits; the argmax of clearly separated logits must survive.
    assert (ours - ref).abs().max() / ref.abs().max() < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_cpu_defaults():
    cfg = RunnerConfig(model_id="unused")
    assert cfg.dtype is None and cfg.attention_backend is None and cfg.num_kv_slots is None


def test_tokenizer_info_of_the_default_model(smollm2_tokenizer):
    info = load_tokenizer_info()
    assert info.tokenizer("Hello world").input_ids == smollm2_tokenizer("Hello world").input_ids
    assert info.eos_token_ids == [2] and info.bos_token_id == 1
    assert info.model_max_length == 8192
    assert "<|im_start|>" in info.chat_template
    assert {0, 1, 2} <= info.special_token_ids
    assert info.tokenizer.decode([1]) == "<|im_start|>"


def test_converted_gguf_tokenizer_is_cached(smollm2_tokenizer):
    folder = gguf_tokenizer_cache_folder(smollm2_gguf_path())  # written by the session fixture
    assert os.path.exists(os.path.join(folder, "tokenizer.json"))
    cached = AutoTokenizer.from_pretrained(folder)
    text = "<|im_start|>user\nHi there<|im_end|>"
    assert cached(text).input_ids == smollm2_tokenizer(text).input_ids


def test_folder_tokenizer_takes_eos_list_from_generation_config(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save_pretrained(tmp_path)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    info = load_tokenizer_info(str(tmp_path))
    assert info.eos_token_ids == [2, 7] and info.model_max_length == 2048


def test_sequence_longer_than_the_model_is_refused():
    model = tiny_hf_model(LlamaConfig)  # max_position_embeddings=512
    hf_config = {**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    cfg = RunnerConfig(device="cpu", dtype="float32", num_kv_slots=2048, max_rows=2, max_seq_len=1024)
    with pytest.raises(ValueError, match="max_seq_len=1024 exceeds the 512 positions"):
        ModelRunner.from_hf_state_dict(hf_config, model.state_dict(), cfg)
