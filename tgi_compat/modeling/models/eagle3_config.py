"""EAGLE-3 draft-head checkpoints: their two config.json formats and tensor names, read into one shape.

- `speculators` (vllm-project/speculators, `"speculators_model_type": "eagle3"`): the decoder layer's Llama config
  nested in `transformer_layer_config`; tensors `layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`.
- EAGLE / SGLang (`"architectures": ["LlamaForCausalLMEagle3"]`): a flat Llama config.json; tensors `midlayer.*`.

Both name the same module: `fc` [H, 3 * H_target] folds three target hidden states into one, a single decoder layer
whose attention reads [embed(token), fc(hidden)] (2 * H wide), `norm`, and `lm_head` over a draft vocabulary whose
ids map to the target's by `d2t` (target = draft + d2t[draft]). The embedding is the target's unless the checkpoint
brings its own. Everything is checked against the target here, so a bad head stops the server at startup.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tgi_compat.modeling.config import ModelConfig

Format = Literal["speculators", "eagle"]
LAYER_PREFIXES = ("layers.0.", "midlayer.")  # speculators', EAGLE's; ours: "layer."
LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", *(f"layer.{name}" for name in LAYER_TENSORS))
OPTIONAL = ("embed_tokens.weight", "d2t", "t2d")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    layer: ModelConfig  # the decoder layer's sizes (a Llama layer)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # target layers whose output the head reads; None: the default three
    norm_before_residual: bool  # the residual is the normed hidden (newer speculators heads), not the raw one
    format: Format

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @staticmethod
    def format_of(d: dict[str, Any]) -> Format | None:
        """The head format of a config.json; None: not an EAGLE-3 head."""
        if d.get("speculators_model_type") == "eagle3" or "transformer_layer_config" in d:
            return "speculators"
        if "LlamaForCausalLMEagle3" in (d.get("architectures") or []):
            return "eagle"
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        fmt = cls.format_of(d)
        if fmt == "speculators":
            layer = dict(d["transformer_layer_config"])
            aux = d.get("eagle_aux_hidden_state_layer_ids")
        elif fmt == "eagle":
            layer = dict(d)
            aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        else:
            raise ValueError(
                "not an EAGLE-3 head: config.json has neither speculators' eagle3 fields nor "
                "architectures LlamaForCausalLMEagle3"
            )
        layer["architectures"] = ["LlamaForCausalLM"]  # one Llama decoder layer, whatever the file says
        layer.setdefault("num_hidden_layers", 1)
        config = ModelConfig.from_hf_dict(layer)
        return cls(
            layer=config,
            draft_vocab_size=int(d.get("draft_vocab_size") or config.vocab_size),
            target_hidden_size=int(d.get("target_hidden_size") or config.hidden_size),
            aux_layer_ids=None if not aux else tuple(int(i) for i in aux),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            format=fmt,
        )

    @classmethod
    def from_folder(cls, folder: str) -> Eagle3Config:
        with open(os.path.join(folder, "config.json")) as f:
            return cls.from_dict(json.load(f))

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a head that cannot draft for this target (sizes and layer ids)."""
        if self.layer.vocab_size != target.vocab_size:
            raise ValueError(
                f"EAGLE-3 head vocabulary {self.layer.vocab_size} != target vocabulary {target.vocab_size}: "
                "the head was trained for another model"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"EAGLE-3 head expects target hidden size {self.target_hidden_size}, the target has {target.hidden_size}"
            )
        if self.draft_vocab_size > target.vocab_size:
            raise ValueError(
                f"EAGLE-3 draft vocabulary {self.draft_vocab_size} exceeds the target's {target.vocab_size}"
            )
        bad = [i for i in self.aux_layer_ids or () if not 0 <= i < target.num_layers]
        if bad or (self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3):
            raise ValueError(
                f"EAGLE-3 eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids or ())} must be 3 layers "
                f"of the target's {target.num_layers}"
            )

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose output (the residual stream after them) the head reads: the checkpoint's, or
        low/mid/high as vLLM and SGLang choose them (the inputs of layers 2, N/2 and N-3)."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))  # (clamped)

    def expected_shapes(self, target_vocab: int) -> dict[str, tuple[int, ...]]:
        c = self.layer
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer = {
            "input_layernorm.weight": (h,),
            "hidden_norm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, 2 * h),
            "self_attn.k_proj.weight": (kv, 2 * h),
            "self_attn.v_proj.weight": (kv, 2 * h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (c.intermediate_size, h),
            "mlp.up_proj.weight": (c.intermediate_size, h),
            "mlp.down_proj.weight": (h, c.intermediate_size),
        }
        return {
            "fc.weight": (h, 3 * self.target_hidden_size),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
            "embed_tokens.weight": (target_vocab, h),
            "d2t": (self.draft_vocab_size,),
            "t2d": (target_vocab,),
            **{f"layer.{name}": shape for name, shape in layer.items()},
        }


def has_own_embedding(folder: str) -> bool:
    """Whether the head's checkpoint brings an embedding (else it borrows the target's); reads only the headers."""
    from safetensors import safe_open

    from tgi_compat.modeling.weights.safetensors import safetensors_files

    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            if any(our_name(name) == "embed_tokens.weight" for name in f.keys()):
                return True
    return False


def our_name(name: str) -> str:
    """A checkpoint tensor's name in either format -> ours (`layer.*` for the decoder layer)."""
    name = name.removeprefix("model.")
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            return "layer." + name.removeprefix(prefix)
    return name


def checked_tensors(
    config: Eagle3Config, weights: Iterable[tuple[str, torch.Tensor]], target_vocab: int
) -> dict[str, torch.Tensor]:
    """The head's tensors under our names, every required one present and every shape right; else ValueError."""
    tensors = {our_name(name): tensor for name, tensor in weights}
    tensors = {name: t for name, t in tensors.items() if name in REQUIRED or name in OPTIONAL}
    missing = [name for name in REQUIRED if name not in tensors]
    if missing:
        raise ValueError(f"EAGLE-3 head checkpoint lacks tensors: {', '.join(missing)}")
    if "d2t" not in tensors and config.draft_vocab_size != target_vocab:
        raise ValueError("EAGLE-3 head has a draft vocabulary of its own but no d2t tensor mapping it to the target's")
    for name, shape in config.expected_shapes(target_vocab).items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(f"EAGLE-3 head tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if "d2t" in tensors:
        targets = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
        if int(targets.min()) < 0 or int(targets.max()) >= target_vocab:
            raise ValueError("EAGLE-3 head d2t maps draft ids outside the target vocabulary")
    return tensors
