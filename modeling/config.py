"""ModelConfig: the few numbers a model family needs, read from a HF config.json or GGUF metadata.

Both sources end in the same dataclass so nothing downstream knows where the weights came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Families whose checkpoints never say `attention_bias` but always carry a q/k/v bias.
_ALWAYS_QKV_BIAS = {"Qwen2ForCausalLM"}
# Families with a per-head RMSNorm on q and k before rotary.
_QK_NORM = {"Qwen3ForCausalLM"}

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(slots=True)
class RopeScaling:
    rope_type: str = "default"  # default | linear | dynamic | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> RopeScaling:
        if not params:
            return cls()
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: default, linear, dynamic, llama3)"
            )
        return cls(
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False  # Llama's attention_bias covers o_proj too; Qwen2's bias does not
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Attention is always full; a checkpoint trained with a window only differs past it (logged).
    sliding_window: int | None = None
    # config.json `quantization_config` of a pre-quantized checkpoint (modeling.layers.quantization)
    quantization_config: dict[str, Any] | None = None

    @property
    def architectures(self) -> list[str]:
        return [self.architecture]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a config.json dict (transformers 4 `rope_scaling` or transformers 5 `rope_parameters`)."""
        architectures = d.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry; cannot choose a model class")
        arch = architectures[0]
        num_heads = d["num_attention_heads"]
        rope_params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        # transformers 5 moves rope_theta inside rope_parameters; older configs keep it top-level.
        rope_theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_dict(rope_params),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bool(d.get("attention_bias", d.get("qkv_bias", False))) or arch in _ALWAYS_QKV_BIAS,
            o_proj_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch in _QK_NORM,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(eos),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
            quantization_config=d.get("quantization_config"),
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], has_output_tensor: bool) -> ModelConfig:
        """From decoded GGUF key/values (see weights.gguf.read_gguf_metadata).

        GGUF files with tied embeddings simply lack the `output.weight` tensor.
        """
        gguf_arch = fields["general.architecture"]
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {gguf_arch!r} (supported: {sorted(GGUF_ARCHITECTURES)})")
        arch = GGUF_ARCHITECTURES[gguf_arch]

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{gguf_arch}.{key}", default)

        num_heads = get("attention.head_count")
        hidden = get("embedding_length")
        vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
        rope_type = get("rope.scaling.type")
        rope_params = {"rope_type": rope_type, "factor": get("rope.scaling.factor", 1.0)} if rope_type else None
        if rope_type == "none":
            rope_params = None
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=num_heads,
            num_kv_heads=get("attention.head_count_kv") or num_heads,
            head_dim=get("attention.key_length") or hidden // num_heads,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=RopeScaling.from_dict(rope_params),
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=arch in _ALWAYS_QKV_BIAS,
            qk_norm=arch in _QK_NORM,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_list(fields.get("tokenizer.ggml.eos_token_id")),
        )


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]
