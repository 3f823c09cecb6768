"""InternLM2 (`InternLM2ForCausalLM`, remote code on the hub) and its reward model (`InternLM2ForRewardModel`,
internlm2-1_8b/7b/20b-reward) as LightLLM serves it (lightllm/models/internlm2_reward: the final norm's last token
times `v_head`, one score per prompt).

The architecture is Llama's (RMSNorm, rope, SwiGLU) under other names, so both are our Llama layers with the
checkpoint renamed on the way in. The one real difference is `attention.wqkv`: q, k and v packed per KV head, each
KV head's group of query heads, then its key, then its value ("(h gs d)" with gs = group + 2 in its modeling file).
It is unpacked into plain q/k/v rows, which the fused q|k|v loader then places (and shards by head under tensor
parallelism: a rank reads the whole wqkv, the heads are interleaved through it). `bias` in its config covers
wqkv and wo (ModelConfig); its MLP has none.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.llama import LlamaForCausalLM
from tgi_compat.modeling.models.pooling import DecoderForPooling
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.weights.lazy import LazyTensor, take

Weight = torch.Tensor | LazyTensor

# InternLM2's module names -> Llama's (w1 = gate, w3 = up, w2 = down)
_RENAMES = {
    "model.tok_embeddings.": "model.embed_tokens.",
    ".attention.wo.": ".self_attn.o_proj.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".attention_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
}
_WQKV = ".attention.wqkv."


class InternLM2ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(llama_names(weights, self.config))


class InternLM2ForRewardModel(DecoderForPooling):
    """The decoder and `v_head` (hidden -> 1, no bias) on each prompt's last token: LightLLM's `score`. The
    reward model is trained to be read at its `reward_token_id` (its `get_score` appends it): clients end the
    prompt with it, as they do with LightLLM."""

    task = "reward"
    head_prefixes: ClassVar[tuple[str, ...]] = ("v_head.",)

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        super().__init__(config, ops, tp)
        self.v_head = Linear(config.hidden_size, 1, bias=False)  # replicated under tensor parallelism

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.v_head(pooled)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(llama_names(weights, self.config))


def llama_names(weights: Iterable[tuple[str, Weight]], config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """InternLM2's checkpoint as Llama's: renamed, `output` as `lm_head`, wqkv unpacked into q_proj/k_proj/v_proj."""
    for name, tensor in weights:
        if _WQKV in name:
            yield from unpack_wqkv(name, tensor, config)
            continue
        name = "lm_head.weight" if name == "output.weight" else name
        for internlm2, llama in _RENAMES.items():
            name = name.replace(internlm2, llama)
        yield name, tensor


def unpack_wqkv(name: str, packed: Weight, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """wqkv's weight [KV * (G + 2) * D, hidden] or bias [KV * (G + 2) * D] -> q [KV * G * D, ...] (query head
    kv * G + g, the order of its modeling file's "(h gs)"), k and v [KV * D, ...]."""
    group = config.num_heads // config.num_kv_heads
    grouped = take(packed).unflatten(0, (config.num_kv_heads, group + 2, config.head_dim))
    parts = {
        "q_proj": grouped[:, :group].flatten(0, 2),
        "k_proj": grouped[:, group].flatten(0, 1),
        "v_proj": grouped[:, group + 1].flatten(0, 1),
    }
    for part, rows in parts.items():
        yield name.replace(_WQKV, f".self_attn.{part}."), rows
