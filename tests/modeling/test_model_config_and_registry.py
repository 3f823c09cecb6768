"""ModelConfig parsing (HF dicts in both transformers generations, GGUF fields) and the registry."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.models.pooling import DecoderForPooling
from tgi_compat.modeling.registry import (
    UnsupportedArchitectureError,
    is_pooling_model,
    resolve_model_class,
    supported_architectures,
)

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_defaults_derive_head_dim_and_kv_heads():
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "eos_token_id": [3, 4]})
    assert (config.head_dim, config.num_kv_heads) == (16, 4)
    assert config.rope_scaling.rope_type == "default" and not config.qkv_bias and not config.qk_norm
    assert config.eos_token_ids == [3, 4]


def test_family_switches():
    qwen2 = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32


@pytest.mark.parametrize(
    "rope_keys",
    [
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}},
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 5e5},
    ],
    ids=["transformers5", "transformers4"],
)
def test_rope_keys_of_both_transformers_generations(rope_keys):
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], **rope_keys})
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor, config.rope_theta) == ("dynamic", 2.0, 5e5)


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "yarn"}})


def test_gguf_fields():
    fields = {
        "general.architecture": "qwen2",
        "qwen2.block_count": 2,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.context_length": 2048,
        "qwen2.vocab_size": 100,
        "tokenizer.ggml.eos_token_id": 7,
    }
    config = ModelConfig.from_gguf_fields(fields, has_output_tensor=False)
    assert config.architecture == "Qwen2ForCausalLM" and config.qkv_bias and config.tie_word_embeddings
    assert (config.num_kv_heads, config.head_dim, config.max_position_embeddings) == (2, 16, 2048)
    assert config.eos_token_ids == [7]


def test_registry_resolves_every_supported_architecture():
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    }
    families = {
        "Gemma3ForConditionalGeneration": "Gemma3ForConditionalGeneration",  # the vision model (its images)
        "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLForConditionalGeneration",  # the same, with M-RoPE
        "Qwen2VLForConditionalGeneration": "Qwen2_5_VLForConditionalGeneration",  # the same family, another tower
        "Gemma": "GemmaForCausalLM",
        "Phi3": "Phi3ForCausalLM",
        "Mixtral": "MixtureOfExpertsForCausalLM",
        "Qwen2Moe": "MixtureOfExpertsForCausalLM",
        "Qwen3Moe": "MixtureOfExpertsForCausalLM",
        "InternLM2": "InternLM2ForCausalLM",  # Llama's layers under its names
    }
    for arch in supported_architectures():
        if is_pooling_model(arch):  # tests/modeling/test_pooling_parity.py, test_internlm2.py
            assert issubclass(resolve_model_class(arch), DecoderForPooling)
            continue
        family = next((cls for prefix, cls in families.items() if arch.startswith(prefix)), "LlamaForCausalLM")
        assert resolve_model_class(arch).__name__ == family


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(UnsupportedArchitectureError, match="'NoSuchLMHeadModel' is not supported .*; native: "):
        resolve_model_class("NoSuchLMHeadModel")


def test_config_without_architectures_is_a_clear_error():
    with pytest.raises(ValueError, match="no 'architectures'"):
        ModelConfig.from_hf_dict(BASE)


# the released vision configs (transformers 4): Qwen2.5-VL-7B's, and Qwen2-VL-7B's (its text width in hidden_size)
_QWEN_VL_HUB_VISION = {
    "qwen2_5_vl": dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14
    ),
    "qwen2_vl": dict(
        depth=32,
        embed_dim=1280,
        mlp_ratio=4,
        num_heads=16,
        in_chans=3,
        hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        spatial_patch_size=14,
        temporal_patch_size=2,
        model_type="qwen2_vl",
    ),
}


@pytest.mark.parametrize(
    "model_type, architecture",
    [("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"), ("qwen2_vl", "Qwen2VLForConditionalGeneration")],
)
def test_qwen_vl_hub_config_is_its_qwen2_text_model_with_mrope(model_type, architecture):
    """The released Qwen2.5-VL-7B and Qwen2-VL-7B config.json (transformers 4: text fields flat, `rope_scaling` type
    mrope); each family's vision tower builds from it."""
    from tgi_compat.modeling.vision.qwen2_5_vl import VISION_TOWERS, QwenVLVisionEncoder

    hub = dict(
        architectures=[architecture], model_type=model_type, hidden_size=3584,
        intermediate_size=18944, num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4,
        max_position_embeddings=128000, rope_theta=1000000.0, sliding_window=32768, use_sliding_window=False,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, vocab_size=152064, eos_token_id=151645,
        image_token_id=151655, vision_config=_QWEN_VL_HUB_VISION[model_type], tie_word_embeddings=False,
    )  # fmt: skip
    config = ModelConfig.from_hf_dict(hub)
    assert (config.architecture, config.multimodal_architecture) == ("Qwen2ForCausalLM", architecture)
    assert config.rope_scaling.rope_type == "default" and config.rope_scaling.mrope_section == [16, 24, 24]
    assert (config.qkv_bias, config.sliding_window, config.rope_theta) == (True, None, 1e6)
    with torch.device("meta"):
        encoder = QwenVLVisionEncoder(hub, VISION_TOWERS[architecture])
    assert (len(encoder.visual.blocks), encoder.visual.merger.mlp[2].out_features) == (32, 3584)
