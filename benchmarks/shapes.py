"""The model shapes the benchmarks build, defined once.

Each model is its transformers config fields (real shapes; weights are random, so nothing is downloaded).
The matmul and attention shapes a decode step runs are derived from them, per tensor-parallel rank.
"""

from __future__ import annotations

# Meta-Llama-3-8B's config.json
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
    bos_token_id=128_000,
    eos_token_id=128_001,
    tie_word_embeddings=False,
)
LLAMA3_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28_672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
# Llama-3's vocabulary on a tiny body: CPU runs of the benchmarks' model paths
LLAMA3_TINY = {
    **LLAMA3_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
QWEN2_7B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
MIXTRAL_8X7B = dict(
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    sliding_window=None,
    tie_word_embeddings=False,
)
GEMMA2_9B = dict(
    architectures=["Gemma2ForCausalLM"],
    model_type="gemma2",
    hidden_size=3584,
    intermediate_size=14336,
    num_hidden_layers=42,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    vocab_size=256000,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)
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
