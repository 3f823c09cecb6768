"""Architecture name (config.json `architectures[0]`) -> model class, imported only when chosen.

Qwen2 and Qwen3 are the Llama family with config switches (`qkv_bias`, `qk_norm`, set in
ModelConfig), so they share one module rather than copying it. Any other architecture that
transformers implements on its AttentionInterface takes the transformers fallback
(models/transformers_fallback.py): transformers' modeling on our attention and KV cache.
"""

from __future__ import annotations

import importlib

from tgi_compat.modeling.models.base import CausalLM

_POOLING = ("Llama", "Mistral", "Qwen2", "Qwen3")  # the decoders with pooling heads

# architecture -> (module under tgi_compat.modeling.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    # its text model (ModelConfig.text_model_of) beside the vision encoder
    "Gemma3ForConditionalGeneration": ("gemma3_vision", "Gemma3ForConditionalGeneration"),
    # one family, two vision towers (modeling/vision/qwen2_5_vl.py)
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtureOfExpertsForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "MixtureOfExpertsForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "MixtureOfExpertsForCausalLM"),
    # pooling models (models/pooling.py): served by the prefill-only engine (tgi_compat/router/pooling_engine.py)
    **{f"{family}ForSequenceClassification": ("pooling", "DecoderForSequenceClassification") for family in _POOLING},
    **{f"{family}Model": ("pooling", "DecoderForEmbedding") for family in _POOLING},
    "Qwen2ForRewardModel": ("pooling", "DecoderForReward"),
    # Llama's layers under other names, q|k|v packed per KV head (models/internlm2.py)
    "InternLM2ForCausalLM": ("internlm2", "InternLM2ForCausalLM"),
    "InternLM2ForRewardModel": ("internlm2", "InternLM2ForRewardModel"),
}

# the classes above that pool (models/pooling.py, and a family's reward head beside its decoder)
_POOLING_CLASSES = {
    "DecoderForSequenceClassification",
    "DecoderForEmbedding",
    "DecoderForReward",
    "InternLM2ForRewardModel",
}


# vision-language checkpoints that neither path serves, and why (README: "Vision-language models")
_REFUSED = {
    # its text model is served (Llama4ForCausalLM: models/llama4.py); its images need transformers' Llama4 image
    # processor, which imports torchvision (not a dependency here)
    "Llama4ForConditionalGeneration": "its images need transformers' Llama 4 image processor, which needs "
    "torchvision (not installed); its text-only checkpoint (Llama4ForCausalLM) is served",
}

NATIVE = "native"
TRANSFORMERS = "transformers"  # the fallback path


class UnsupportedArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    """The architectures with a native model file (any other may take the transformers fallback)."""
    return sorted(_MODELS)


def modeling_path(architecture: str) -> str:
    """NATIVE or TRANSFORMERS; raises UnsupportedArchitectureError when neither can serve it."""
    if architecture in _MODELS:
        return NATIVE
    if architecture in _REFUSED:
        raise UnsupportedArchitectureError(
            f"model architecture {architecture!r} is not supported: {_REFUSED[architecture]}"
        )
    from tgi_compat.modeling.models.transformers_fallback import check_supported

    reason = check_supported(architecture)
    if reason is not None:
        raise UnsupportedArchitectureError(
            f"model architecture {architecture!r} is not supported ({reason}); "
            f"native: {', '.join(supported_architectures())}"
        )
    return TRANSFORMERS


def describe_modeling_path(architecture: str) -> str:
    """What the start-up log says serves `architecture`: "native", "transformers", or for a multimodal
    checkpoint the native path of its text model and its vision encoder."""
    from tgi_compat.modeling.config import FALLBACK_VISION_MODELS, MULTIMODAL_TEXT_MODELS

    path = modeling_path(architecture)
    if architecture in MULTIMODAL_TEXT_MODELS:
        return f"{path} modeling of its text model {MULTIMODAL_TEXT_MODELS[architecture]} and vision encoder"
    if architecture in FALLBACK_VISION_MODELS:
        return f"{path} modeling of its text model and vision encoder"
    return f"{path} modeling"


def is_pooling_model(architecture: str) -> bool:
    """Whether the architecture embeds or scores prompts instead of generating (models/pooling.py)."""
    return _MODELS.get(architecture, ("", ""))[1] in _POOLING_CLASSES


def resolve_model_class(architecture: str) -> type[CausalLM]:
    if modeling_path(architecture) == TRANSFORMERS:
        from tgi_compat.modeling.config import FALLBACK_VISION_MODELS

        if architecture == "MllamaForConditionalGeneration":  # its text cross-attends to the images
            from tgi_compat.modeling.models.mllama import MllamaForConditionalGeneration

            return MllamaForConditionalGeneration
        if architecture == "Llama4ForCausalLM":  # its NoPE layers scale their queries by position
            from tgi_compat.modeling.models.llama4 import Llama4ForCausalLM

            return Llama4ForCausalLM
        if architecture in FALLBACK_VISION_MODELS:
            from tgi_compat.modeling.models.transformers_vlm import VISION_CLASSES

            return VISION_CLASSES[architecture]
        from tgi_compat.modeling.models.transformers_fallback import TransformersForCausalLM

        return TransformersForCausalLM
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"tgi_compat.modeling.models.{module_name}")
    return getattr(module, class_name)
