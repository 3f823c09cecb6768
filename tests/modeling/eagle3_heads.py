"""Tiny random EAGLE-3 heads for a tiny Llama target, saved in the speculators or the EAGLE/SGLang format, and a
plain torch reference of the head's forward (written from the paper and the formats, apart from our module)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.modeling.helpers import TINY_SIZES

# the target: TINY_SIZES with 4 layers (low/mid/high distinct) and a head dim of 64 (the GPU kernels'); the head:
# one layer of the same sizes
TARGET = dict(TINY_SIZES, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
TARGET |= dict(num_attention_heads=2, num_key_value_heads=1)
HEAD_LAYER = dict(TARGET, num_hidden_layers=1, rope_theta=10000.0)
AUX_LAYERS = [0, 1, 3]
DRAFT_VOCAB = 64  # the draft vocabulary: every 4th target id (d2t[i] = 3 * i)


def random_head_tensors(seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Our names (`layer.*`); float32."""
    g = torch.Generator().manual_seed(seed)
    h, inter = HEAD_LAYER["hidden_size"], HEAD_LAYER["intermediate_size"]
    heads, kv_heads = HEAD_LAYER["num_attention_heads"], HEAD_LAYER["num_key_value_heads"]
    d = h // heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1 + rand(h)

    return {
        "fc.weight": rand(h, 3 * TARGET["hidden_size"]),
        "norm.weight": norm(),
        "lm_head.weight": rand(DRAFT_VOCAB, h) * 5,
        "d2t": torch.arange(DRAFT_VOCAB) * 3,
        "t2d": torch.arange(TARGET["vocab_size"]) % 4 == 0,
        "layer.input_layernorm.weight": norm(),
        "layer.hidden_norm.weight": norm(),
        "layer.post_attention_layernorm.weight": norm(),
        "layer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "layer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
        "layer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * h),
        "layer.self_attn.o_proj.weight": rand(h, heads * d),
        "layer.mlp.gate_proj.weight": rand(inter, h),
        "layer.mlp.up_proj.weight": rand(inter, h),
        "layer.mlp.down_proj.weight": rand(h, inter),
    }


def save_head(folder: Path, fmt: str, tensors: dict[str, torch.Tensor], **config_overrides) -> str:
    """A head folder in `fmt` ("speculators" or "eagle"): its config.json and model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "speculators":
        prefix = "layers.0."
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": dict(HEAD_LAYER, architectures=["LlamaForCausalLM"]),
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": AUX_LAYERS,
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny-llama"}},
        }
    else:
        prefix = "midlayer."
        config = dict(
            HEAD_LAYER,
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=DRAFT_VOCAB,
            eagle_config={"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
        )
    config |= config_overrides
    (folder / "config.json").write_text(json.dumps(config))
    named = {name.replace("layer.", prefix, 1) if name.startswith("layer.") else name: t for name, t in tensors.items()}
    save_file({name: t.contiguous() for name, t in named.items()}, str(folder / "model.safetensors"))
    return str(folder)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + HEAD_LAYER["rms_norm_eps"]) * w


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, N, D], rotate-half
    d = x.shape[-1]
    inv = 1.0 / HEAD_LAYER["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def reference_drafts(
    t: dict[str, torch.Tensor], embed: torch.Tensor, tokens: list[int], aux: torch.Tensor, k: int
) -> list[int]:
    """EAGLE-3's k greedy drafts after `tokens`, from the target's aux hidden states [len(tokens), 3H], by
    recomputing the head's whole sequence each draft (no cache): inputs (token p + 1, h_p) at every position p."""
    heads, kv_heads = HEAD_LAYER["num_attention_heads"], HEAD_LAYER["num_key_value_heads"]
    h = HEAD_LAYER["hidden_size"]
    d = h // heads
    ids = list(tokens[1:])
    hidden = aux[: len(tokens) - 1] @ t["fc.weight"].T  # [n, H]
    drafts: list[int] = []
    for _ in range(k):
        n = len(ids)
        x = torch.cat(
            (_rms(embed[ids], t["layer.input_layernorm.weight"]), _rms(hidden, t["layer.hidden_norm.weight"])), -1
        )
        positions = torch.arange(n)
        q = _rope((x @ t["layer.self_attn.q_proj.weight"].T).view(n, heads, d), positions)
        key = _rope((x @ t["layer.self_attn.k_proj.weight"].T).view(n, kv_heads, d), positions)
        v = (x @ t["layer.self_attn.v_proj.weight"].T).view(n, kv_heads, d)
        key, v = key.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, key) / d**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h)
        residual = attn @ t["layer.self_attn.o_proj.weight"].T + hidden
        y = _rms(residual, t["layer.post_attention_layernorm.weight"])
        mlp = (
            torch.nn.functional.silu(y @ t["layer.mlp.gate_proj.weight"].T) * (y @ t["layer.mlp.up_proj.weight"].T)
        ) @ t["layer.mlp.down_proj.weight"].T
        prenorm = mlp + residual
        draft = int((_rms(prenorm[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
        token = draft + int(t["d2t"][draft])
        drafts.append(token)
        ids.append(token)  # the draft is the next input; the head's own pre-norm output its hidden state
        hidden = torch.cat((hidden, prenorm[-1:]))
    return drafts
