"""InternLM2 in plain torch, written from its hub modeling file (modeling_internlm2.py, remote code that transformers
does not ship): `InternLM2ForCausalLM`, or with `reward=True` `InternLM2ForRewardModel` (its `v_head` on the last
token). Module names are the checkpoint's, so `save` writes a folder our loader reads as the hub's."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from tests.modeling.helpers import TINY_SIZES, randomize

REWARD_TOKEN_ID = 7  # the tiny reward model's `reward_token_id` (92527 in the released ones)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["hidden_size"] // self.num_heads
        self.theta = config["rope_theta"]
        packed = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.wqkv = nn.Linear(config["hidden_size"], packed, bias=config["bias"])
        self.wo = nn.Linear(self.num_heads * self.head_dim, config["hidden_size"], bias=config["bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length, groups, dim = x.shape[0], self.num_heads // self.num_kv_heads, self.head_dim
        # "b q (h gs d) -> b q h gs d": per KV head its group of query heads, its key, its value
        qkv = self.wqkv(x).view(length, self.num_kv_heads, groups + 2, dim)
        q = qkv[:, :, :groups].reshape(length, self.num_heads, dim)  # "(h gs)": query head kv * groups + g
        k, v = qkv[:, :, -2], qkv[:, :, -1]
        q, k = self.rotate(q), self.rotate(k)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # repeat_kv
        scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.wo(torch.einsum("hqk,khd->qhd", weights, v).reshape(length, -1))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """InternLM2RotaryEmbedding and apply_rotary_pos_emb (rotate_half) at positions 0..L-1."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(x.shape[0]).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * emb.cos() + rotated * emb.sin()


class FeedForward(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.feed_forward = FeedForward(config["hidden_size"], config["intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class InternLM2Model(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(self, ids: list[int]) -> torch.Tensor:
        hidden = self.tok_embeddings(torch.tensor(ids))
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)  # [L, hidden]


class InternLM2Reference(nn.Module):
    def __init__(self, reward: bool = False, bias: bool = True, **overrides) -> None:
        super().__init__()
        architecture = "InternLM2ForRewardModel" if reward else "InternLM2ForCausalLM"
        self.config = {
            **TINY_SIZES,
            "architectures": [architecture],
            "model_type": "internlm2",
            "bias": bias,
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "reward_token_id": REWARD_TOKEN_ID,
            **overrides,
        }
        self.model = InternLM2Model(self.config)
        self.head = nn.Linear(self.config["hidden_size"], 1 if reward else self.config["vocab_size"], bias=False)
        self.head_name = "v_head" if reward else "output"
        randomize(self)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """InternLM2ForCausalLM: [L, vocab]."""
        return self.head(self.model(ids))

    @torch.no_grad()
    def reward(self, ids: list[int]) -> torch.Tensor:
        """InternLM2ForRewardModel: [1], v_head on the last token (the one its attention mask ends at)."""
        return self.head(self.model(ids)[-1])

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        tensors = {self._checkpoint_name(name): t.contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(self.config, f)

    def _checkpoint_name(self, name: str) -> str:
        """`head.weight` as the checkpoint names it: `output.weight` or `v_head.weight`."""
        return self.head_name + name.removeprefix("head") if name.startswith("head.") else name
