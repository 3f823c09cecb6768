"""Weight loading: one entry point for every checkpoint format (safetensors folder or GGUF file)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.registry import TRANSFORMERS, modeling_path
from tgi_compat.modeling.source import ModelSource
from tgi_compat.modeling.weights.lazy import LazyTensor, take

LOAD_FORMATS = ("auto", "dummy")  # vLLM's --load-format values we serve: the checkpoint, or random weights
Weights = Iterator[tuple[str, torch.Tensor | LazyTensor]]


def load_model_config(source: ModelSource, load_format: str = "auto") -> ModelConfig:
    """The model's config.json (or GGUF metadata). load_format "dummy": the transformers fallback is
    told of no checkpoint to read, so that it takes the (random) weights the runner streams to it."""
    if source.is_gguf:
        from tgi_compat.modeling.weights.gguf import has_output_tensor, open_gguf, read_gguf_metadata

        reader = open_gguf(source.gguf_file)
        return ModelConfig.from_gguf_fields(read_gguf_metadata(reader), has_output_tensor(reader))
    with open(os.path.join(source.folder, "config.json")) as f:
        d = json.load(f)
    architecture = (d.get("architectures") or [None])[0]
    if architecture is not None and modeling_path(architecture) == TRANSFORMERS:
        from tgi_compat.modeling.models.transformers_fallback import fallback_model_config

        return fallback_model_config(d, source.folder if load_format != "dummy" else None)
    return ModelConfig.from_hf_dict(d)


def iterate_weights(
    source: ModelSource,
    config: ModelConfig,
    show_progress: bool = True,
    lazy: bool = False,
    load_format: str = "auto",
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """(HF parameter name, tensor) pairs; the model copies each into place (device, dtype).
    lazy (tensor parallelism): LazyTensors, from which each parameter reads only its rank's part.
    load_format "dummy": random tensors of the checkpoint's names and shapes, made on `device` in
    `dtype` (no weight files needed); "auto": the checkpoint's own, on the CPU."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r} (choose {', '.join(LOAD_FORMATS)})")
    if load_format == "dummy":
        yield from _dummy_weights(source, config, device or torch.device("cpu"), dtype, lazy)
    elif source.is_gguf:
        from tgi_compat.modeling.weights.gguf import iterate_gguf, open_gguf

        yield from iterate_gguf(open_gguf(source.gguf_file), config.num_heads, config.num_kv_heads, show_progress, lazy)
    else:
        from tgi_compat.modeling.weights.safetensors import iterate_safetensors

        weights = iterate_safetensors(source.folder, show_progress, lazy)
        yield from text_model_weights(weights) if config.renames_multimodal_weights else weights


def _dummy_weights(source: ModelSource, config: ModelConfig, device: torch.device, dtype: torch.dtype, lazy: bool):
    from tgi_compat.modeling.weights.dummy import iterate_dummy_weights

    if source.is_gguf:
        raise ValueError("--load-format dummy needs a model folder with config.json, not a GGUF file")
    if config.quantization_config is not None:
        raise ValueError(
            "--load-format dummy makes unquantized weights, but config.json describes a quantized checkpoint; "
            "drop its quantization_config (--quantize fp8 or eetq quantizes the random weights while loading)"
        )
    weights = iterate_dummy_weights(source.folder, device, dtype, lazy)
    return text_model_weights(weights) if config.renames_multimodal_weights else weights


# A multimodal checkpoint's text-model prefixes -> the text model's own (transformers 4 and the hub
# save `language_model.model.*`; transformers 5 names its modules `model.language_model.*`)
_TEXT_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
    # the vision encoder's (models/gemma3_vision.py VISION_PREFIX); transformers 5's SigLIP has no `vision_model.`
    ("model.vision_tower.vision_model.", "vision.vision_tower."),
    ("vision_tower.vision_model.", "vision.vision_tower."),
    ("model.vision_tower.", "vision.vision_tower."),
    ("vision_tower.", "vision.vision_tower."),
    ("model.multi_modal_projector.", "vision.multi_modal_projector."),
    ("multi_modal_projector.", "vision.multi_modal_projector."),
    # Qwen2(.5)-VL's (models/qwen2_5_vl.py): the hub keeps the text model at `model.`, the encoder at `visual.`
    ("model.visual.", "vision.visual."),
    ("visual.", "vision.visual."),
    ("model.", "model."),
)


def text_model_weights(weights: Weights) -> Weights:
    """The tensors of a multimodal checkpoint under the names of our model of it: the text model's own, the
    vision encoder's under `vision.`."""
    for name, tensor in weights:
        for prefix, target in _TEXT_MODEL_PREFIXES:
            if name.startswith(prefix):
                yield target + name.removeprefix(prefix), tensor
                break


def read_tensor(
    source: ModelSource,
    config: ModelConfig,
    name: str,
    load_format: str = "auto",
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One checkpoint tensor by its HF name, whole, on `device` in `dtype` (read lazily: nothing else is loaded)."""
    for found, tensor in iterate_weights(source, config, False, lazy=True, load_format=load_format, device=device):
        if found == name:
            return take(tensor).to(device, dtype)
    raise KeyError(f"the checkpoint has no tensor {name}")
