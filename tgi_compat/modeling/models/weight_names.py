"""Checkpoint tensors into a model's parameters: the HF names every family shares, with the q/k/v and
gate/up projections fused on the way (each parameter's `weight_loader` places its shard)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn as nn

from tgi_compat.modeling.layers.quantization.base import LoadableParameter
from tgi_compat.modeling.weights.lazy import LazyTensor

# checkpoint sub-module -> (our fused module, shard)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
    tie_word_embeddings: bool,
    resolve: Callable[[str], tuple[str, object]] | None = None,
) -> None:
    """Copy (HF name, tensor) pairs into model's parameters; raises on unknown or missing tensors.
    `resolve` maps a checkpoint name to (parameter name, shard); default: fused_name."""
    resolve = resolve or fused_name
    params = dict(model.named_parameters())
    pending = set(params)
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and tie_word_embeddings:
            continue  # some tied checkpoints still store it; the embedding is the one we keep
        target, shard = resolve(name)
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        param = cast(LoadableParameter, params[target])  # our layers create every parameter with a loader
        param.weight_loader(param, tensor, shard)
        pending.discard(target)
    if tie_word_embeddings:
        pending.discard("lm_head.weight")
    if pending:
        raise ValueError(f"checkpoint is missing weights: {sorted(pending)[:8]}")


def fused_name(name: str) -> tuple[str, object]:
    for source, (target, shard) in PACKED_MODULES.items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{target}."), shard
    return name, None
