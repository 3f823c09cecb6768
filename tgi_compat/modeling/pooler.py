"""Pooling: a prompt's final hidden states -> one vector per request (an embedding, or a score head's input).

Which token(s) and whether to L2-normalize follow the checkpoint: a sentence-transformers folder says it in
`modules.json` (a `Normalize` module) and `1_Pooling/config.json` (`pooling_mode_*`); otherwise a decoder embeds
with its last token, normalized (as vLLM does), and a classification head reads the last token that is not
padding (as transformers does, both for left- and right-padded input).
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgi_compat.modeling.forward_batch import ForwardBatch


class PoolingType(enum.Enum):
    LAST = "last"
    MEAN = "mean"
    CLS = "cls"


# sentence-transformers' 1_Pooling/config.json switches -> our pooling
_ST_MODES = {
    "pooling_mode_lasttoken": PoolingType.LAST,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
}
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    pooling: PoolingType = PoolingType.LAST
    normalize: bool = False
    # LAST skips trailing (and any) tokens equal to it, as transformers' classification heads do
    pad_token_id: int | None = None


def sentence_transformers_pooler(folder: str) -> PoolerConfig | None:
    """The pooler a sentence-transformers folder declares; None when it declares none."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.exists(modules_path):
        return None
    with open(modules_path) as f:
        modules = json.load(f)
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    pooling = PoolingType.LAST
    for module in modules:
        if module.get("type") != "sentence_transformers.models.Pooling":
            continue
        with open(os.path.join(folder, module["path"], "config.json")) as f:
            switches = json.load(f)
        chosen = [mode for key, mode in _ST_MODES.items() if switches.get(key)]
        if len(chosen) != 1:
            on = sorted(k for k, v in switches.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"unsupported sentence-transformers pooling {on} (supported: one of {sorted(_ST_MODES)})")
        pooling = chosen[0]
    return PoolerConfig(pooling, normalize)


def pool(hidden: torch.Tensor, batch: ForwardBatch, config: PoolerConfig) -> torch.Tensor:
    """hidden [T, H] of a step whose requests bring their whole prompt (q_lens == kv_lens) -> [B, H]."""
    if config.pooling == PoolingType.MEAN:
        segment = torch.repeat_interleave(
            torch.arange(batch.batch_size, device=hidden.device), batch.q_lens, output_size=batch.num_tokens
        )
        sums = torch.zeros(batch.batch_size, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segment, hidden.float())
        pooled = (sums / batch.q_lens.unsqueeze(1)).to(hidden.dtype)
    elif config.pooling == PoolingType.CLS:
        pooled = hidden[batch.q_start]
    else:
        pooled = hidden[last_token_indices(batch, config.pad_token_id)]
    return F.normalize(pooled, p=2, dim=-1) if config.normalize else pooled


def last_token_indices(batch: ForwardBatch, pad_token_id: int | None) -> torch.Tensor:
    """[B]: each request's last token, or with a pad id its last token that is not padding (its first token
    when every token is padding: transformers' argmax over an all-zero row)."""
    last = batch.q_start + batch.q_lens - 1
    if pad_token_id is None:
        return last
    positions = torch.arange(batch.num_tokens, device=batch.input_ids.device)
    segment = torch.repeat_interleave(
        torch.arange(batch.batch_size, device=positions.device), batch.q_lens, output_size=batch.num_tokens
    )
    candidates = torch.where(batch.input_ids != pad_token_id, positions, batch.q_start[segment])
    return batch.q_start.scatter_reduce(0, segment, candidates, reduce="amax", include_self=True)
