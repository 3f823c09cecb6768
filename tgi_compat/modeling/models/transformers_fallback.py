"""Any other decoder-only model, through transformers' own modeling on our KV cache.

transformers computes the embeddings, norms, MLPs and rotary itself; only attention is ours: it is
registered with transformers' AttentionInterface under ATTENTION_NAME and the model is built with
that implementation (as TGI 3 and vLLM's TransformersForCausalLM do). Each attention call stores the
new tokens' k/v into their token slots and attends through our backend (torch or Triton), so the
model runs on the flat, unpadded token batch of the router's continuous batching like the native
families. transformers then needs no cache of its own, and no mask: the backend knows each request's
extent. A model qualifies when its attention goes through the interface (`_supports_attention_backend`).

Loaded from a folder, transformers reads the checkpoint itself (`from_pretrained`), so its own key
renames and tensor conversions apply; the runner's weight stream is then left unread. Under tensor
parallelism (models/transformers_sharding.py) each rank builds its shard and reads its slices from that stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn

from tgi_compat.modeling.attention.base import AttentionBackend, AttentionParams
from tgi_compat.modeling.config import (
    CROSS_ATTENTION_MODELS,
    FALLBACK_VISION_MODELS,
    MLLAMA_EXTRA_EMBEDDING_ROWS,
    ModelConfig,
)
from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.transformers_sharding import TextModelShard
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.weights.lazy import LazyTensor, take

ATTENTION_NAME = "tgi_compat_kv"


@dataclass
class KVCacheStep:
    """What our attention function needs in one forward, passed down through transformers' kwargs."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend
    # each layer's attention chunk (transformers' "chunked_attention" layers; Llama 4's local ones), None: global
    attention_chunks: Sequence[int | None] = ()
    # a layer's [T] factor on its queries, by each token's position (Llama 4's NoPE layers' temperature)
    query_scales: Mapping[int, torch.Tensor] = field(default_factory=dict)


def kv_cache_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: returns ([1, T, H, D], no weights)."""
    step: KVCacheStep = kwargs["kv_cache_step"]
    layer = cast(int, module.layer_idx)  # transformers' attention modules number their layer
    k_cache, v_cache = step.kv_caches[layer]
    q = query[0].transpose(0, 1)  # [T, H, D]
    if layer in step.query_scales:  # in fp32, rounded once, as transformers scales them
        q = (q * step.query_scales[layer][:, None, None]).to(q.dtype)
    step.backend.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    chunk = step.attention_chunks[layer] if step.attention_chunks else None
    params = AttentionParams(scale, kwargs.get("sliding_window"), kwargs.get("softcap"), chunk)
    out = step.backend.forward(q, k_cache, v_cache, params)
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the backend masks by each request's positions; transformers builds nothing


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kv_cache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def transformers_config(d: dict[str, Any]):
    from transformers import AutoConfig

    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def fallback_model_config(d: dict[str, Any], folder: str | None = None) -> ModelConfig:
    """ModelConfig from any config.json transformers can read (its attribute maps give the usual names);
    `folder`, where the checkpoint lives, is kept as the config's `_name_or_path` (as transformers does)."""
    if folder is not None:
        d = {**d, "_name_or_path": folder}
    wrapper = transformers_config(d)
    c = wrapper.get_text_config()  # a vision checkpoint's text model (nested text_config); else the config itself
    num_heads = c.num_attention_heads
    eos = d.get("eos_token_id", c.eos_token_id)  # a vision wrapper's own generation ids win
    architecture = d["architectures"][0]
    vision = architecture in FALLBACK_VISION_MODELS
    # Mllama: only its self-attention layers hold paged KV; vocab_size counts its embedding's rows, which a prompt
    # may hold (`<|image|>` past the logits' vocabulary)
    cross = c.cross_attention_layers if architecture in CROSS_ATTENTION_MODELS else []
    return ModelConfig(
        architecture=architecture,
        vocab_size=c.vocab_size + MLLAMA_EXTRA_EMBEDDING_ROWS if cross else c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
        num_layers=c.num_hidden_layers - len(cross),
        num_heads=num_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
        max_position_embeddings=getattr(c, "max_position_embeddings", None) or 2048,
        tie_word_embeddings=bool(getattr(wrapper, "tie_word_embeddings", False)),
        bos_token_id=c.bos_token_id,
        eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)],
        hf_config=d,
        multimodal_architecture=architecture if vision else None,
        multimodal_hf_config=d if vision else None,
    )


def check_supported(architecture: str) -> str | None:
    """Why transformers' `architecture` cannot run on our KV cache, or None when it can."""
    import transformers

    model_cls = getattr(transformers, architecture, None)
    if model_cls is None:
        return f"transformers {transformers.__version__} has no model class {architecture!r}"
    if not getattr(model_cls, "_supports_attention_backend", False):
        return f"{architecture}'s attention does not go through transformers' AttentionInterface"
    return None


class TransformersForCausalLM(nn.Module):
    # the text model splits as transformers' plan for the family says, where that plan is Llama's
    # (models/transformers_sharding.py; others refuse with their reason)
    supports_tensor_parallel = True

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        super().__init__()
        register_attention()
        self.config = config
        hf_config = transformers_config(config.hf_config)
        # sharded: built at this rank's shard's shape, then loaded from the runner's stream of this rank's slices
        text_config = hf_config.get_text_config()  # a vision checkpoint's text model, else the config itself
        self.shard = TextModelShard(config, text_config, tp, self.tp_plan(text_config)) if tp.is_sharded else None
        folder: str = config.hf_config.get("_name_or_path") or ""
        self.loaded_by_transformers = bool(folder) and os.path.isdir(folder) and self.shard is None
        options = dict(attn_implementation=self.attention_implementation(), dtype=torch.get_default_dtype())
        model_class = self.model_class()
        if self.loaded_by_transformers:
            device_map = {"": torch.get_default_device()}
            # use_kernels=False: transformers >= 5.2x otherwise swaps layers for kernels fetched from the hub at load
            self.hf = model_class.from_pretrained(
                folder, config=hf_config, device_map=device_map, use_kernels=False, **options
            )
        elif self.shard is not None:  # at this rank's shapes, filled with its slices by load_weights
            self.hf = self.build_shard(model_class, hf_config, options)
        else:  # in-memory weights (tests, --load-format dummy): built here, filled by load_weights
            self.hf = model_class.from_config(hf_config, **options)
        if self.shard is not None:
            self.shard.attach(self.hf, self.text_model())
            with torch.device("meta"):  # the whole model's shapes, allocating nothing
                whole = model_class.from_config(transformers_config(config.hf_config), **options)
            self.shard.check_shapes(whole, self.hf)
        self.logit_scale = getattr(text_config, "logit_scale", None)  # Cohere-style scaled logits
        self.final_softcap = getattr(text_config, "final_logit_softcapping", None)
        # transformers marks chunked local layers by type, and masks them; our backend needs the chunk instead
        chunk = getattr(text_config, "attention_chunk_size", None)
        layer_types = getattr(text_config, "layer_types", None) or []
        self.attention_chunks = [chunk if kind == "chunked_attention" else None for kind in layer_types]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The flat batch as one sequence of T tokens; returns the final hidden states [T, hidden]."""
        step = KVCacheStep(kv_caches, backend, self.attention_chunks, self.query_scales(positions))
        return self.run_text(input_ids, self.text_positions(positions)[None], batch, step)

    # what a vision-language model (models/transformers_vlm.py, models/mllama.py) changes
    def run_text(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: ForwardBatch, step: KVCacheStep
    ) -> torch.Tensor:
        out = self.text_model()(
            **self.text_inputs(input_ids, batch), position_ids=position_ids, use_cache=False, kv_cache_step=step
        )
        return out.last_hidden_state[0]

    def tp_plan(self, text_config: Any) -> dict[str, str] | None:
        """How the text model splits over the ranks, in transformers' terms: its family's plan by default."""
        return text_config.base_model_tp_plan

    def build_shard(self, model_class: Any, hf_config: Any, options: dict[str, Any]) -> nn.Module:
        """The model at this rank's shapes (its text config already shrunk to them), its weights not yet read."""
        return model_class.from_config(hf_config, **options)

    def model_class(self) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    @staticmethod
    def attention_implementation() -> str | dict[str, str]:
        return ATTENTION_NAME

    def text_model(self) -> nn.Module:
        return self.hf.base_model

    def text_inputs(self, input_ids: torch.Tensor, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        return {"input_ids": input_ids[None]}

    def text_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions the text model rotates by (PaliGemma's start at 1)."""
        return positions

    def query_scales(self, positions: torch.Tensor) -> Mapping[int, torch.Tensor]:
        """KVCacheStep.query_scales of this step's tokens at `positions` (Llama 4's); none by default."""
        return {}

    def model_name(self, name: str) -> str:
        """A checkpoint tensor's name -> the module's, as transformers' renamings (not its tensor converters) give
        it when it reads a folder: the hub's LLaVA-Next `language_model.model.*` is transformers 5's
        `model.language_model.*`."""
        return name

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.hf.get_output_embeddings()
        # [R, vocab], or sharded: [R, this rank's padded vocabulary block]
        logits = (head(hidden) if self.shard is None else self.shard.vocab_block(head, hidden)).float()
        if self.logit_scale:
            logits = logits * self.logit_scale
        if self.final_softcap:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        """A state dict under transformers' own parameter names; nothing to do if it read the folder."""
        if self.loaded_by_transformers:
            return
        state = {}
        for name, tensor in weights:
            key = self.model_name(name)
            state[key] = take(tensor) if self.shard is None else self.shard.take(key, tensor)
        missing, unexpected = self.hf.load_state_dict(state, strict=False)
        self.hf.tie_weights()
        tied = {"lm_head.weight", "embed_out.weight"} if self.config.tie_word_embeddings else set()
        missing = [name for name in missing if name not in tied]
        if unexpected:
            raise KeyError(f"checkpoint tensors with no matching parameter: {sorted(unexpected)[:8]}")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
