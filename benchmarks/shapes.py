"""The model shapes the benchmarks build, defined once.

Each model is its transformers config fields (real shapes; weights are random, so nothing is downloaded).
The matmul and attention shapes a decode step runs are derived from them, per tensor-parallel rank.
"""

from __future__ import annotations


def decoder(architecture: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, **more):
    """A decoder's transformers config fields: its shape, then the family's own fields."""
    model_type = {"Llama": "llama", "Qwen2": "qwen2", "Mixtral": "mixtral", "Gemma2": "gemma2"}
    config = dict(architectures=[architecture], model_type=model_type[architecture.removesuffix("ForCausalLM")])
    config |= dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab)
    return config | dict(num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False) | more


# Meta-Llama-3-8B's config.json; 70B is its wider, deeper sibling with the same vocabulary and KV heads
LLAMA3 = dict(rope_theta=500_000.0, rms_norm_eps=1e-5, bos_token_id=128_000, eos_token_id=128_001)
LLAMA3_8B = decoder("LlamaForCausalLM", 4096, 14_336, 32, 32, 8, 128_256, max_position_embeddings=8192, **LLAMA3)
LLAMA3_70B = decoder("LlamaForCausalLM", 8192, 28_672, 80, 64, 8, 128_256, max_position_embeddings=8192, **LLAMA3)
# Llama-3's vocabulary on a tiny body: CPU runs of the benchmarks' model paths
LLAMA3_TINY = decoder("LlamaForCausalLM", 64, 128, 2, 4, 2, 128_256, max_position_embeddings=4096, **LLAMA3)
QWEN2 = dict(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
QWEN2_7B = decoder("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 152064, **QWEN2)
MIXTRAL = dict(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None)
MIXTRAL_8X7B = decoder("MixtralForCausalLM", 4096, 14336, 32, 32, 8, 32000, **MIXTRAL)
MIXTRAL_8X7B |= dict(num_local_experts=8, num_experts_per_tok=2)
GEMMA2 = dict(max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=4096, tie_word_embeddings=True)
GEMMA2_SOFTCAPS = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256)
GEMMA2_9B = decoder("Gemma2ForCausalLM", 3584, 14336, 42, 16, 8, 256000, head_dim=256, **GEMMA2, **GEMMA2_SOFTCAPS)
MODELS = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": LLAMA3_70B,
    "llama3-tiny": LLAMA3_TINY,
    "qwen2-7b": QWEN2_7B,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "gemma2-9b": GEMMA2_9B,
}
# (experts, intermediate size, hidden size, top-k) of MoE models whose experts alone are tuned
EXPERTS = {
    "mixtral-8x7b": (8, 14336, 4096, 2),
    "qwen3-30b-a3b": (128, 768, 2048, 8),
    "qwen2-57b-a14b": (64, 2560, 3584, 8),
}


def attention_heads(model: dict, num_shard: int = 1) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of one rank's attention."""
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    return model["num_attention_heads"] // num_shard, model["num_key_value_heads"] // num_shard, head_dim


def projections(model: dict, num_shard: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of every matmul of a decode step, one rank's shard: q|k|v, o, gate|up, down, the LM head."""
    heads, kv_heads, head_dim = attention_heads(model, num_shard)
    hidden, inter = model["hidden_size"], model["intermediate_size"] // num_shard
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (model["vocab_size"] // num_shard, hidden),
    }
