"""Architecture name (config.json `architectures[0]`) -> model class, imported only when chosen.

Qwen2 and Qwen3 are the Llama family with config switches (`qkv_bias`, `qk_norm`, set in
ModelConfig), so they share one module rather than copying it.
"""

from __future__ import annotations

import importlib

import torch.nn as nn

# architecture -> (module under modeling.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtureOfExpertsForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "MixtureOfExpertsForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "MixtureOfExpertsForCausalLM"),
}


class UnsupportedArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"modeling.models.{module_name}")
    return getattr(module, class_name)
