"""Pooling models of the Llama family (Llama, Mistral, Qwen2, Qwen3): the shared decoder without its LM head,
a pooler (tgi_compat/modeling/pooler.py) and a head over the pooled hidden state.

- `*ForSequenceClassification`: transformers' `score` Linear (no bias) on the last token that is not padding.
- `Qwen2ForRewardModel` (Qwen2.5-Math-RM): a `score` MLP (Linear, ReLU, Linear) to one reward, on the last token.
- the bare decoders (`LlamaModel`, `Qwen2Model`, ...): embedding models, pooled as their folder says.

Under tensor parallelism the decoder is sharded as Llama's is; its output is whole on every rank (the last
layer's sum), so the pooler and the head run on it unsharded: the head's weights are replicated, not split.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn as nn

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.decoder import DecoderModel, DecoderStack
from tgi_compat.modeling.models.llama import llama_layer, llama_rope
from tgi_compat.modeling.models.weight_names import load_packed_weights
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.pooler import PoolerConfig, PoolingType, pool
from tgi_compat.modeling.weights.lazy import LazyTensor


class DecoderForPooling(DecoderStack):
    """The decoder and a head; `pool` is what the runner calls (the PoolingLM interface of models/base.py)."""

    task: ClassVar[str]  # "embed" | "classify" | "reward": which routes serve it (tgi_compat.api)
    supports_tensor_parallel = True
    head_prefixes: ClassVar[tuple[str, ...]] = ("score.",)  # the head's checkpoint names, beside "model."

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        layers = (llama_layer(config, ops, i, tp) for i in range(config.num_layers))
        super().__init__(config, DecoderModel(config, ops, layers, llama_rope(config, ops), tp=tp))
        self.pooler = PoolerConfig()

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, output]; embedding models output the pooled state itself."""
        return pooled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on single rows (a per-token score): what a runner step that is not pooling returns."""
        return self.head(hidden)

    def pool(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[T, hidden] of whole prompts -> [B, output]."""
        return self.head(pool(hidden, batch, self.pooler))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        # a bare decoder's checkpoint (AutoModel, sentence-transformers) names its tensors without "model."
        named = ((n if n.startswith(("model.", *self.head_prefixes)) else f"model.{n}", t) for n, t in weights)
        load_packed_weights(self, named, tie_word_embeddings=False)


class DecoderForEmbedding(DecoderForPooling):
    task = "embed"

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        super().__init__(config, ops, tp)
        self.pooler = PoolerConfig(PoolingType.LAST, normalize=True)  # unless the folder says otherwise


class DecoderForSequenceClassification(DecoderForPooling):
    task = "classify"

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        super().__init__(config, ops, tp)
        self.score = Linear(config.hidden_size, num_labels(config.hf_config), bias=False)
        self.pooler = PoolerConfig(PoolingType.LAST, pad_token_id=config.hf_config.get("pad_token_id"))

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


class DecoderForReward(DecoderForPooling):
    task = "reward"

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        super().__init__(config, ops, tp)
        hidden = config.hidden_size
        # one reward, whatever labels the config lists (its transformers default is two)
        self.score = nn.Sequential(Linear(hidden, hidden, bias=True), nn.ReLU(), Linear(hidden, 1, bias=True))

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


def num_labels(hf_config: dict) -> int:
    """transformers' `num_labels`: the size of `id2label` when the config has one."""
    id2label = hf_config.get("id2label")
    return len(id2label) if id2label else int(hf_config.get("num_labels", 2))
