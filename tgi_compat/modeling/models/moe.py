"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (shared expert with its gate) and Qwen3-MoE.

They are the Llama model (attention, norms, rope, qkv bias / q-k norm switches) with a sparse MoE
block in place of the MLP on the layers that have one (Qwen's `mlp_only_layers` and
`decoder_sparse_step` keep some dense). Routing is softmax, top-k, then renormalised for Mixtral
always and for Qwen when `norm_topk_prob` says so. Tensor parallelism shards the attention and
dense layers as Llama's and each expert's intermediate dim (layers/moe.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.layers.moe import SparseMoeBlock
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.decoder import Attention, DecoderForCausalLM, DecoderLayer, DecoderModel
from tgi_compat.modeling.models.llama import LlamaMLP, llama_rope
from tgi_compat.modeling.models.weight_names import fused_name, load_packed_weights
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.weights.lazy import LazyTensor

# Checkpoint names of one expert's matrices, Mixtral's (w1 gate, w3 up, w2 down) and Qwen's.
_EXPERT_RE = re.compile(
    r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# transformers 5's in-memory layout: every expert in one tensor
_STACKED_RE = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True, slots=True)
class MoEKnobs:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: frozenset[int]

    @classmethod
    def from_config(cls, config: ModelConfig) -> MoEKnobs:
        d = config.hf_config
        is_mixtral = config.architecture == "MixtralForCausalLM"
        num_experts = d.get("num_local_experts") or d["num_experts"]  # transformers 5 saves either name
        step = d.get("decoder_sparse_step") or 1
        dense = set(d.get("mlp_only_layers") or [])
        sparse = frozenset(i for i in range(config.num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            num_experts=num_experts,
            top_k=d["num_experts_per_tok"],
            expert_intermediate_size=config.intermediate_size if is_mixtral else d["moe_intermediate_size"],
            renormalize=is_mixtral or bool(d.get("norm_topk_prob", False)),
            shared_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
            sparse_layers=sparse,
        )


class MixtureOfExpertsForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = True

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        knobs = MoEKnobs.from_config(config)
        layers = (moe_layer(config, ops, i, knobs, tp) for i in range(config.num_layers))
        super().__init__(config, DecoderModel(config, ops, layers, llama_rope(config, ops), tp=tp), tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        load_packed_weights(self, weights, self.config.tie_word_embeddings, resolve=moe_weight_name)


def moe_layer(
    config: ModelConfig, ops: LayerOps, layer: int, knobs: MoEKnobs, tp: TensorParallel = NO_TP
) -> DecoderLayer:
    """A Llama layer whose MLP is a sparse MoE block, except on the layers the config keeps dense."""
    attention = Attention(config, ops, sliding_window=config.sliding_window_of(layer), tp=tp)
    if layer not in knobs.sparse_layers:
        return DecoderLayer(config, ops, attention, LlamaMLP(config, ops, tp))
    experts = SparseMoeBlock(
        config.hidden_size,
        knobs.num_experts,
        knobs.top_k,
        knobs.expert_intermediate_size,
        knobs.renormalize,
        ops,
        knobs.shared_intermediate_size,
        tp,
    )
    return DecoderLayer(config, ops, attention, experts)


def moe_weight_name(name: str) -> tuple[str, object]:
    """Checkpoint name -> (parameter, shard): experts into the stacked w13/w2, Mixtral's
    `block_sparse_moe` into `mlp`, everything else as in the Llama family."""
    match = _EXPERT_RE.match(name)
    if match:
        prefix, expert, kind = match.groups()
        part = _EXPERT_PARTS[kind]
        return f"{prefix}.mlp.experts.{'w2' if part == 'down' else 'w13'}", (int(expert), part)
    match = _STACKED_RE.match(name)
    if match:
        prefix, kind = match.groups()
        return f"{prefix}.mlp.experts.{'w13' if kind == 'gate_up_proj' else 'w2'}", None
    return fused_name(name.replace(".block_sparse_moe.", ".mlp."))
