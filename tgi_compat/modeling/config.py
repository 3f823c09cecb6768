"""ModelConfig: the few numbers a model family needs, read from a HF config.json or GGUF metadata.

Both sources end in the same dataclass so nothing downstream knows where the weights came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Families whose checkpoints never say `attention_bias` but always carry a q/k/v bias.
_ALWAYS_QKV_BIAS = {
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen2ForSequenceClassification",
    "Qwen2ForRewardModel",
    "Qwen2Model",
}
# Families with a per-head RMSNorm on q and k before rotary.
_QK_NORM = {
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3ForSequenceClassification",
    "Qwen3Model",
}

# InternLM2 names its q|k|v and o biases together `bias`, true unless the config says otherwise (its config class).
_ONE_BIAS_KEY = {"InternLM2ForCausalLM", "InternLM2ForRewardModel"}

# Qwen's vision-language family: one native model (models/qwen2_5_vl.py), two vision towers
QWEN_VL_MODELS = ("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration")
# Multimodal checkpoints: the wrapper's architecture -> its text model's (served beside the wrapper's
# vision encoder, models/gemma3_vision.py).
MULTIMODAL_TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    **{name: "Qwen2ForCausalLM" for name in QWEN_VL_MODELS},  # with M-RoPE (rope_scaling.mrope_section)
}
# Vision-language checkpoints that the transformers fallback serves whole, images included
# (models/transformers_vlm.py): their ModelConfig is the text model's, with the wrapper as multimodal_architecture
FALLBACK_VISION_MODELS = frozenset(
    {
        "LlavaNextForConditionalGeneration",
        "Idefics3ForConditionalGeneration",
        "Idefics2ForConditionalGeneration",
        "PaliGemmaForConditionalGeneration",
        "MllamaForConditionalGeneration",
    }
)
# those whose text cross-attends to its images (tgi_compat/router/cross_attention.py) instead of reading placeholders
CROSS_ATTENTION_MODELS = frozenset({"MllamaForConditionalGeneration"})
# Mllama's text embedding has this many rows past its config's vocab_size (transformers' MllamaTextModel), the
# first `<|image|>`, which prompts hold; its LM head covers vocab_size only (the logits are padded: models/mllama.py)
MLLAMA_EXTRA_EMBEDDING_ROWS = 8
# Wrapper config.json keys that hold for the text model too (the wrapper's generation ids win)
_WRAPPER_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings", "quantization_config")

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@dataclass(slots=True)
class RopeScaling:
    rope_type: str = "default"  # default | linear | dynamic | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None
    short_factor: list[float] | None = None  # longrope only: per-frequency divisors inside the original context
    long_factor: list[float] | None = None  # longrope only: past it
    attention_factor: float | None = None  # longrope only: cos/sin scale; None: from factor
    # Qwen2(.5)-VL's multimodal rope: the t/h/w sections of the D/2 frequencies (default frequencies otherwise)
    mrope_section: list[int] | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> RopeScaling:
        if not params:
            return cls()
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
        rope_type = "default" if rope_type == "mrope" else rope_type  # transformers 4's name for Qwen2(.5)-VL's
        if rope_type not in ("default", "linear", "dynamic", "llama3", "longrope"):
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: default, linear, dynamic, llama3, longrope)"
            )
        return cls(
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
            short_factor=params.get("short_factor"),
            long_factor=params.get("long_factor"),
            attention_factor=params.get("attention_factor"),
            mrope_section=params.get("mrope_section"),
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
    sliding_window: int | None = None
    # per layer "full_attention" | "sliding_attention"; None: every layer slides when sliding_window is set
    layer_types: list[str] | None = None
    # the config.json it came from: family-specific knobs (Gemma's soft-caps, MoE sizes) are read from it
    # by their model file, so this dataclass stays the set every family shares
    hf_config: dict[str, Any] = field(default_factory=dict)
    # config.json `quantization_config` of a pre-quantized checkpoint (tgi_compat.modeling.layers.quantization)
    quantization_config: dict[str, Any] | None = None
    # the checkpoint's multimodal wrapper (MULTIMODAL_TEXT_MODELS) when this is its text model
    multimodal_architecture: str | None = None
    multimodal_hf_config: dict[str, Any] | None = None  # that wrapper's config.json (its vision encoder's)

    @property
    def renames_multimodal_weights(self) -> bool:
        """Whether our native model of a multimodal checkpoint takes its tensors renamed (weights.loader's
        text_model_weights); the transformers fallback keeps transformers' names."""
        return self.multimodal_architecture in MULTIMODAL_TEXT_MODELS

    @property
    def architectures(self) -> list[str]:
        return [self.architecture]

    def sliding_window_of(self, layer: int) -> int | None:
        """The window of layer `layer` (None: full attention)."""
        if not self.sliding_window:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a config.json dict (transformers 4 `rope_scaling` or transformers 5 `rope_parameters`)."""
        architectures = d.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry; cannot choose a model class")
        arch = architectures[0]
        if arch in MULTIMODAL_TEXT_MODELS:
            return cls.text_model_of(d)
        num_heads = d["num_attention_heads"]
        rope_params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        # transformers 5 moves rope_theta inside rope_parameters; older configs keep it top-level.
        rope_theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        rope_scaling = RopeScaling.from_dict(rope_params)
        attention_bias = d.get("bias", True) if arch in _ONE_BIAS_KEY else d.get("attention_bias")
        if rope_scaling.rope_type == "longrope":  # Phi-3 keeps the original context beside, not inside
            original = rope_scaling.original_max_position_embeddings or d.get("original_max_position_embeddings")
            rope_scaling.original_max_position_embeddings = original or d.get("max_position_embeddings", 4096)
            if "factor" not in rope_params:
                rope_scaling.factor = (
                    d.get("max_position_embeddings", 4096) / rope_scaling.original_max_position_embeddings
                )
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
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bool(d.get("qkv_bias", False) if attention_bias is None else attention_bias)
            or arch in _ALWAYS_QKV_BIAS,
            o_proj_bias=bool(attention_bias),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch in _QK_NORM,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(eos),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
            layer_types=d.get("layer_types") or _default_layer_types(arch, d),
            hf_config=d,
            quantization_config=d.get("quantization_config"),
        )

    @classmethod
    def text_model_of(cls, d: dict[str, Any]) -> ModelConfig:
        """The text model of a multimodal config.json. Hub configs keep only the non-default text
        fields (gemma-3-4b-it: hidden size, layers, window, rope scaling), so transformers' own
        config class fills in the rest, as transformers does when it loads the checkpoint."""
        from transformers import AutoConfig

        wrapper = d["architectures"][0]
        fields = {key: value for key, value in d.items() if key != "model_type"}
        text = AutoConfig.for_model(d["model_type"], **fields).get_text_config().to_dict()
        text |= {key: d[key] for key in _WRAPPER_KEYS if key in d}
        text["architectures"] = [MULTIMODAL_TEXT_MODELS[wrapper]]
        # transformers' wrapper never applies its text config's final soft-cap (released checkpoints have none)
        text["final_logit_softcapping"] = None
        config = cls.from_hf_dict(text)
        config.multimodal_architecture = wrapper
        config.multimodal_hf_config = d
        return config

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
        num_layers = get("block_count")
        head_dim = get("attention.key_length") or hidden // num_heads
        sliding_window = get("attention.sliding_window")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=get("attention.head_count_kv") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=RopeScaling.from_dict(rope_params),
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=arch in _ALWAYS_QKV_BIAS,
            qk_norm=arch in _QK_NORM,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_list(fields.get("tokenizer.ggml.eos_token_id")),
            sliding_window=sliding_window,
            layer_types=_default_layer_types(arch, {"num_hidden_layers": num_layers}) if sliding_window else None,
            hf_config=_gguf_family_knobs(get, rope_params),
        )


def _gguf_family_knobs(get, rope_params: dict[str, Any] | None) -> dict[str, Any]:
    """The config.json keys family files read beyond ModelConfig, from GGUF metadata (Gemma's soft-caps
    and rope bases; llama.cpp stores no query_pre_attn_scalar, so Gemma scales by head_dim, as it does)."""
    knobs = {
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
        "rope_theta": get("rope.freq_base"),
        "rope_scaling": rope_params,
    }
    return {key: value for key, value in knobs.items() if value is not None}


def _default_layer_types(arch: str, d: dict[str, Any]) -> list[str] | None:
    """transformers 4 configs carry no layer_types: Gemma 2 alternates (even layers slide), Gemma 3
    has one global layer per `sliding_window_pattern`; any other windowed model slides everywhere."""
    num_layers = d["num_hidden_layers"]
    if arch == "Gemma2ForCausalLM":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    return None


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]
