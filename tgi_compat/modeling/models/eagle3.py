"""The EAGLE-3 draft head (Li et al. 2025): one Llama decoder layer that drafts the target's next tokens from
its own last token's embedding and the target's hidden states.

Position p's input is (token p + 1, h_p), where h_p is the target's three auxiliary hidden states at p folded to
one by `fc` (or, for the head's own later drafts, the head's pre-norm output at p - 1). The layer's attention
reads [input_layernorm(embed(token)), hidden_norm(h)] (2 * H wide); its output predicts token p + 2 over the draft
vocabulary, mapped to target ids by `d2t`.

Eager torch over a step's drafting requests at once (rows padded to the longest), each request's K/V in a small
cache of its own (`DraftKV`), padded side by side for the step (`BatchedKV`). The checkpoint formats and their checks: eagle3_config.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from tgi_compat.kernels.attention.rotary import rotary_embedding_ref
from tgi_compat.modeling.dtypes import default_dtype
from tgi_compat.modeling.layers.rotary import build_cos_sin
from tgi_compat.modeling.models.eagle3_config import Eagle3Config, checked_tensors
from tgi_compat.modeling.source import resolve_model_source
from tgi_compat.modeling.weights.safetensors import iterate_safetensors


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = config.layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = _linear(2 * c.hidden_size, c.num_heads * c.head_dim)
        self.k_proj = _linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim)
        self.v_proj = _linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim)
        self.o_proj = _linear(c.num_heads * c.head_dim, c.hidden_size)


class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = config.layer
        self.input_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.mlp = _Mlp(c.hidden_size, c.intermediate_size)


@dataclass(slots=True)
class DraftKV:
    """One request's head K/V: rows in position order (rotated keys), [n, kv heads, head dim] each."""

    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return self.k.shape[0]

    def joined(self, other: DraftKV) -> DraftKV:
        return DraftKV(torch.cat((self.k, other.k)), torch.cat((self.v, other.v)))

    def first(self, num: int) -> DraftKV:
        return DraftKV(self.k[:num], self.v[:num])


@dataclass(slots=True)
class BatchedKV:
    """Several requests' K/V side by side, padded: [B, N, kv heads, head dim] each; `valid` [B, N] marks the real
    rows (attention has no order once keys are rotated, so rows may be appended past the padding)."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, caches: Sequence[DraftKV]) -> BatchedKV:
        k = pad_sequence([c.k for c in caches], batch_first=True)
        lengths = torch.tensor([len(c) for c in caches], device=k.device)
        valid = torch.arange(k.shape[1], device=k.device)[None, :] < lengths[:, None]
        return cls(k, pad_sequence([c.v for c in caches], batch_first=True), valid)

    def appended(self, k: torch.Tensor, v: torch.Tensor) -> BatchedKV:
        """With one more real row per request ([B, 1, kv heads, head dim])."""
        valid = torch.cat((self.valid, self.valid.new_ones(k.shape[0], k.shape[1])), 1)
        return BatchedKV(torch.cat((self.k, k), 1), torch.cat((self.v, v), 1), valid)


class Eagle3Head(nn.Module):
    d2t: torch.Tensor  # [draft vocab] int64: target id = draft id + d2t[draft id]
    cos: torch.Tensor  # [P, D/2], a buffer
    sin: torch.Tensor

    def __init__(self, config: Eagle3Config, target_vocab: int):
        super().__init__()
        c = config.layer
        self.config = config
        self.fc = _linear(3 * config.target_hidden_size, c.hidden_size)
        # no memory until load(): the checkpoint's, or (usually) the target's own tensor, shared
        self.embed_tokens = nn.Embedding(target_vocab, c.hidden_size, device="meta")
        self.layer = _Layer(config)
        self.norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = _linear(c.hidden_size, config.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        cos, sin = build_cos_sin(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def empty_kv(self) -> DraftKV:
        a = self.layer.self_attn
        empty = self.fc.weight.new_empty(0, a.num_kv_heads, a.head_dim)
        return DraftKV(empty, empty)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, M]: the token after each position
        positions: torch.Tensor,  # [B, M]
        hidden: torch.Tensor,  # [B, M, 3 * H_target] (the target's) or [B, M, H] (the head's pre-norm output)
        cache: BatchedKV,  # each request's rows before these
        num_new: torch.Tensor,  # [B]: each request's real rows (>= 1) of the M; the rest is padding
        from_target: bool,  # hidden is the target's (folded by fc), not the head's own
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(draft-vocabulary logits [B, M, V_draft], pre-norm hidden [B, M, H] for the next draft, the new rows' K
        and V [B, M, kv heads, head dim])."""
        if from_target:
            hidden = self.fc(hidden)
        layer = self.layer
        if self.config.norm_before_residual:
            hidden = residual = layer.hidden_norm(hidden)
        else:
            residual, hidden = hidden, layer.hidden_norm(hidden)
        x = torch.cat((layer.input_layernorm(self.embed_tokens(input_ids)), hidden), dim=-1)
        out, k, v = self._attend(x, positions, cache, num_new)
        residual = out + residual
        prenorm = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.lm_head(self.norm(prenorm)), prenorm, k, v

    def _attend(
        self, x: torch.Tensor, positions: torch.Tensor, cache: BatchedKV, num_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.layer.self_attn
        b, m = x.shape[:2]
        flat = positions.reshape(-1)
        q = rotary_embedding_ref(a.q_proj(x).view(b * m, a.num_heads, a.head_dim), self.cos, self.sin, flat)
        k = rotary_embedding_ref(a.k_proj(x).view(b * m, a.num_kv_heads, a.head_dim), self.cos, self.sin, flat)
        k, v = k.view(b, m, a.num_kv_heads, a.head_dim), a.v_proj(x).view(b, m, a.num_kv_heads, a.head_dim)
        group = a.num_heads // a.num_kv_heads
        keys = torch.cat((cache.k, k), 1).float().repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, N + M, D]
        values = torch.cat((cache.v, v), 1).float().repeat_interleave(group, dim=2).transpose(1, 2)
        queries = q.view(b, m, a.num_heads, a.head_dim).float().transpose(1, 2)  # [B, H, M, D]
        scores = queries @ keys.transpose(2, 3) * a.head_dim**-0.5  # [B, H, M, N + M]
        # row i sees its request's cached rows and its new rows 0..i (of the real ones)
        rows = torch.arange(m, device=x.device)
        causal = (rows[None, None, :] <= rows[None, :, None]) & (rows[None, None, :] < num_new[:, None, None])
        visible = torch.cat((cache.valid[:, None, :].expand(b, m, -1), causal), 2)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        out = (scores.softmax(-1) @ values).transpose(1, 2).reshape(b, m, a.num_heads * a.head_dim)
        return a.o_proj(out.to(x.dtype)), k, v

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load(self, tensors: dict[str, torch.Tensor], target_embedding: torch.Tensor | None) -> None:
        """Checked tensors (eagle3_config.checked_tensors) in; the target's embedding where the head has none."""
        tensors = dict(tensors)
        embedding = tensors.pop("embed_tokens.weight", None)
        if embedding is None:
            if target_embedding is None or target_embedding.shape != self.embed_tokens.weight.shape:
                raise ValueError("EAGLE-3 head has no embed_tokens and the target's embedding does not fit it")
            embedding = target_embedding
        dtype = self.fc.weight.dtype
        # (detached: a plain tensor on the same memory, whatever parameter class the target's embedding is)
        self.embed_tokens.weight = nn.Parameter(embedding.detach().to(dtype), requires_grad=False)
        tensors.setdefault("d2t", torch.zeros(self.config.draft_vocab_size, dtype=torch.int64))
        tensors.pop("t2d", None)  # (the target -> draft mask: only training reads it)
        state = self.state_dict()
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].copy_(tensor.to(state[name].dtype))


def load_eagle3_head(
    model_id: str,
    target_vocab: int,
    target_embedding: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    config: Eagle3Config | None = None,
) -> Eagle3Head:
    """The head in folder (or hub id) `model_id`, in either format, checked, on `device` in `dtype`."""
    folder = resolve_model_source(model_id).folder
    config = config or Eagle3Config.from_folder(folder)
    weights = ((name, cast(torch.Tensor, t)) for name, t in iterate_safetensors(folder, show_progress=False))
    tensors = checked_tensors(config, weights, target_vocab)  # (not lazy: tensors, never slices)
    with torch.device(device), default_dtype(dtype):  # (built in place: no float32 copy first)
        head = Eagle3Head(config, target_vocab)
    head.load({name: t.to(device) for name, t in tensors.items()}, target_embedding)
    return head.eval()
