"""The EAGLE-3 draft head (Li et al. 2025): one Llama decoder layer that drafts the target's next tokens from
its own last token's embedding and the target's hidden states.

Position p's input is (token p + 1, h_p), where h_p is the target's three auxiliary hidden states at p folded to
one by `fc` (or, for the head's own later drafts, the head's pre-norm output at p - 1). The layer's attention
reads [input_layernorm(embed(token)), hidden_norm(h)] (2 * H wide); its output predicts token p + 2 over the draft
vocabulary, mapped to target ids by `d2t`.

Eager torch, one request at a time, with its K/V in a small per-request cache (`DraftKV`): a head of one layer is
a fraction of a target step. The checkpoint formats and their checks: eagle3_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

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
        input_ids: torch.Tensor,  # [m]: the token after each position
        positions: torch.Tensor,  # [m], ascending, all past the cache's
        hidden: torch.Tensor,  # [m, 3 * H_target] (the target's) or [m, H] (the head's pre-norm output)
        cache: DraftKV,
        from_target: bool,  # hidden is the target's (folded by fc), not the head's own
    ) -> tuple[torch.Tensor, torch.Tensor, DraftKV]:
        """(draft-vocabulary logits [m, V_draft], pre-norm hidden [m, H] for the next draft, the m new K/V rows)."""
        if from_target:
            hidden = self.fc(hidden)
        layer = self.layer
        if self.config.norm_before_residual:
            hidden = residual = layer.hidden_norm(hidden)
        else:
            residual, hidden = hidden, layer.hidden_norm(hidden)
        x = torch.cat((layer.input_layernorm(self.embed_tokens(input_ids)), hidden), dim=-1)
        out, new = self._attend(x, positions, cache)
        residual = out + residual
        prenorm = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.lm_head(self.norm(prenorm)), prenorm, new

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, cache: DraftKV) -> tuple[torch.Tensor, DraftKV]:
        a = self.layer.self_attn
        m = x.shape[0]
        q = rotary_embedding_ref(a.q_proj(x).view(m, a.num_heads, a.head_dim), self.cos, self.sin, positions)
        k = rotary_embedding_ref(a.k_proj(x).view(m, a.num_kv_heads, a.head_dim), self.cos, self.sin, positions)
        new = DraftKV(k, a.v_proj(x).view(m, a.num_kv_heads, a.head_dim))
        every = cache.joined(new)
        n = len(every)
        group = a.num_heads // a.num_kv_heads
        keys = every.k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        values = every.v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) * a.head_dim**-0.5  # [H, m, n]
        # new row i sees the cache and new rows 0..i
        visible = torch.arange(n, device=x.device)[None, :] <= torch.arange(n - m, n, device=x.device)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out = (scores.softmax(-1) @ values).transpose(0, 1).reshape(m, a.num_heads * a.head_dim)
        return a.o_proj(out.to(x.dtype)), new

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
