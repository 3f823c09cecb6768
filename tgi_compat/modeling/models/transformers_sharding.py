"""Tensor parallelism for the transformers fallback (models/transformers_fallback.py): this rank's share of the text
model, as the native families split theirs (parallel/sharding.py), where transformers' plan for the family
(`base_model_tp_plan`) is Llama's: q/k/v column-parallel, o row-parallel, each MLP's input projections column- and
its output projection row-parallel.

The text config is shrunk to this rank's heads and MLP rows before transformers builds the model, so its linears are
born at their shard's shape (a rank never holds the whole model) and its attention modules, which view q/k/v by
head_dim, hand our attention function only the local heads: the KV cache holds this rank's KV heads, as for the
native families. Loading narrows each sharded tensor to this rank's rows (column-parallel) or columns
(row-parallel); a row-parallel linear's output is summed over the ranks by a forward hook, its bias added once (rank
0's). The embedding, norms and vision tower stay whole on every rank; the LM head computes this rank's vocabulary
block (parallel/vocab_logits.py gathers or reduces the blocks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.parallel import Slice, TensorParallel, shard_heads, split_evenly, vocab_shard
from tgi_compat.modeling.weights.lazy import LazyTensor, take

COLUMN, ROW = "colwise", "rowwise"
# the attention projections every plan we apply names, and how each splits: by query heads or by KV heads
_ATTENTION = {"q_proj": (COLUMN, "q"), "k_proj": (COLUMN, "kv"), "v_proj": (COLUMN, "kv"), "o_proj": (ROW, "q")}
_ATTENTION_PREFIX = "layers.*.self_attn."
# attention modules that split by heads as self-attention does: Mllama's cross-attention too (models/mllama.py)
_ATTENTION_PREFIXES = (_ATTENTION_PREFIX, "layers.*.cross_attn.")
# kept whole on every rank: exact, at the cost of its memory (a per-head-dim q/k norm is the same on every head)
_REPLICATED = {"embedding_rowwise", "replicated_with_grad_allreduce"}


@dataclass(frozen=True)
class ShardedLinear:
    pattern: re.Pattern[str]  # the linear's module name under the text model
    dim: int  # 0: its output features split (column-parallel), 1: its input features (row-parallel)
    features: Slice  # this rank's features along dim


def plan_refusal(model_type: str, plan: dict[str, str] | None, text_config: Any) -> str | None:
    """Why the fallback cannot shard this text model, or None when its plan is one it applies."""
    if not plan:
        return f"transformers has no tensor-parallel plan (base_model_tp_plan) for {model_type}"
    for name, (style, _) in _ATTENTION.items():
        if plan.get(_ATTENTION_PREFIX + name) != style:
            found = plan.get(_ATTENTION_PREFIX + name, "nothing")
            return f"{model_type}'s plan shards {_ATTENTION_PREFIX}{name} as {found!r}, not {style!r}"
    for key, style in plan.items():
        if style not in (COLUMN, ROW, *_REPLICATED):
            return f"{model_type}'s plan shards {key} as {style!r}, which the fallback does not apply"
    if "intermediate_size" not in text_config.to_dict():
        return f"{model_type}'s config names no intermediate_size to split its MLP by"
    return None


class TextModelShard:
    """This rank's linears of the text model, and its vocabulary block."""

    def __init__(self, config: ModelConfig, text_config: Any, tp: TensorParallel, plan: dict[str, str] | None) -> None:
        """Shrinks `text_config` (transformers', built into the model after this) to this rank's heads and MLP
        rows; raises ValueError where the family's plan (its `base_model_tp_plan`) is not one we apply."""
        model_type = text_config.model_type
        reason = plan_refusal(model_type, plan, text_config)
        if reason is not None:
            raise ValueError(
                f"the transformers fallback cannot shard {config.architecture} (--num-shard > 1): {reason}"
            )
        assert plan is not None  # plan_refusal refuses a missing one
        self.tp, self.architecture = tp, config.architecture
        heads = shard_heads(config.num_heads, config.num_kv_heads, tp)
        mlp = split_evenly(text_config.intermediate_size, tp.size, tp.rank)
        by_heads = {"q": heads.q_heads.scaled(config.head_dim), "kv": heads.kv_heads.scaled(config.head_dim)}
        self.linears: list[ShardedLinear] = []
        for key, style in plan.items():
            if style in _REPLICATED:
                continue
            prefix = next((prefix for prefix in _ATTENTION_PREFIXES if key.startswith(prefix)), None)
            role = None if prefix is None else _ATTENTION.get(key.removeprefix(prefix))
            features = by_heads[role[1]] if role is not None else mlp
            pattern = re.compile(re.escape(key).replace(r"\*", r"\d+"))
            self.linears.append(ShardedLinear(pattern, 0 if style == COLUMN else 1, features))
        # the model is built at its shard's shape; head_dim is set, as it no longer follows hidden_size / heads
        text_config.num_attention_heads = heads.num_heads
        text_config.num_key_value_heads = heads.num_kv_heads
        text_config.head_dim = config.head_dim
        text_config.intermediate_size = mlp.size
        self.vocab_rows, self.vocab_padded = vocab_shard(config.vocab_size, tp)
        self.prefix = ""  # the text model's name in the whole model (attach)

    def _linear(self, module_name: str) -> ShardedLinear | None:
        return next((linear for linear in self.linears if linear.pattern.fullmatch(module_name)), None)

    def _linear_of(self, name: str) -> tuple[ShardedLinear | None, str]:
        """The sharded linear a parameter of the whole model (`name`) belongs to, if any, and its kind (weight, bias)."""
        module_name, _, kind = name.rpartition(".")
        in_text = name.startswith(self.prefix)
        return (self._linear(module_name.removeprefix(self.prefix)) if in_text else None), kind

    def attach(self, model: nn.Module, text_model: nn.Module) -> None:
        """Once the model is built: every row-parallel linear's partial output -> the sum over the ranks (a forward
        hook); checkpoint names are read under the text model's name in `model`."""
        self.prefix = next(name for name, module in model.named_modules() if module is text_model) + "."
        for name, module in text_model.named_modules():
            linear = self._linear(name)
            if linear is not None and linear.dim == 1:
                module.register_forward_hook(lambda _module, _inputs, out: self.tp.all_reduce(out))

    def check_shapes(self, whole: nn.Module, model: nn.Module) -> None:
        """Raises ValueError unless every parameter of `model` (built at this rank's shapes) is the one of `whole` (the
        same model on the meta device, at the checkpoint's) narrowed as this shard reads it: a weight that splits
        with the heads but is not in transformers' plan (Cohere's per-head q/k norms) cannot be split here."""
        shapes = {name: tuple(param.shape) for name, param in whole.named_parameters()}
        for name, param in model.named_parameters():
            expected = list(shapes[name])
            linear, kind = self._linear_of(name)
            if linear is not None and not (kind == "bias" and linear.dim == 1):
                fits = linear.features.end <= expected[linear.dim]
                expected[linear.dim] = linear.features.size if fits else -1  # (-1: no shape matches)
            if tuple(param.shape) != tuple(expected):
                raise ValueError(
                    f"the transformers fallback cannot shard {self.architecture} (--num-shard > 1): {name} is "
                    f"{list(shapes[name])} in the checkpoint and {list(param.shape)} at this rank's heads and MLP "
                    f"rows, which is not this rank's part of it under transformers' plan"
                )

    def take(self, name: str, tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor named as the model's parameter `name` (others: whole)."""
        linear, kind = self._linear_of(name)
        if linear is None:
            return take(tensor)
        if kind == "bias" and linear.dim == 1:  # a row-parallel bias is added once, after the sum
            return take(tensor) if self.tp.rank == 0 else torch.zeros(tensor.shape)
        return take(tensor, linear.dim, linear.features.start, linear.features.size)

    def vocab_block(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's block of the logits [R, padded vocab / ranks] from the (whole) LM head: its rows' logits,
        -inf for ids the head has no row for (Mllama's `<|image|>` and the 7 past it: never sampled), zeros past
        the vocabulary."""
        assert isinstance(head, nn.Linear)
        rows = self.vocab_rows
        bias = None if head.bias is None else head.bias[rows.start : rows.end]
        block = F.linear(hidden, head.weight[rows.start : rows.end], bias)
        block = F.pad(block, (0, rows.size - block.shape[-1]), value=float("-inf"))
        return F.pad(block, (0, self.vocab_padded - rows.size))
