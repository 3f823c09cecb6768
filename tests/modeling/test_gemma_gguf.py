"""Gemma GGUF metadata and tensor names (checked end to end on gemma-3-270m Q4_K_M: logits equal to
transformers' own GGUF load; that file is too slow to load in CI)."""

from __future__ import annotations

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.models.gemma import GemmaKnobs
from tgi_compat.modeling.weights.gguf import hf_tensor_name

# gemma-3-270m's GGUF metadata (llama.cpp's converter)
GEMMA3_270M_FIELDS = {
    "general.architecture": "gemma3",
    "gemma3.context_length": 32768,
    "gemma3.embedding_length": 640,
    "gemma3.block_count": 18,
    "gemma3.feed_forward_length": 2048,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
    "gemma3.attention.key_length": 256,
    "gemma3.attention.value_length": 256,
    "gemma3.rope.freq_base": 1000000.0,
    "gemma3.attention.sliding_window": 512,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.vocab_size": 262144,
    "tokenizer.ggml.bos_token_id": 2,
    "tokenizer.ggml.eos_token_id": 1,
}


def test_gemma3_gguf_config():
    config = ModelConfig.from_gguf_fields(GEMMA3_270M_FIELDS, has_output_tensor=False)
    assert config.architecture == "Gemma3ForCausalLM" and config.qk_norm and config.tie_word_embeddings
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.sliding_window) == (4, 1, 256, 512)
    windows = [config.sliding_window_of(i) for i in range(config.num_layers)]
    assert windows[:6] == [512] * 5 + [None] and windows.count(None) == 3  # one global layer in six
    knobs = GemmaKnobs.from_config(config)
    assert knobs.local_rope_theta == 10000.0 and knobs.global_rope[0] == 1e6
    assert knobs.attention_scale == 256**-0.5 and knobs.attn_softcap is None and knobs.final_softcap is None


def test_gemma_sandwich_norm_tensor_names():
    assert hf_tensor_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.3.post_ffw_norm.weight", "gemma2") == "model.layers.3.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.3.post_attention_norm.weight", "gemma3") == (
        "model.layers.3.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"  # Llama's
