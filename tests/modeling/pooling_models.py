"""Tiny random pooling checkpoints (classification, reward, embedding) saved as safetensors folders, and
transformers' answers on them: shared by the modeling, engine and server tests of pooling."""

from __future__ import annotations

import json
import os

import torch
import transformers
from safetensors.torch import save_file

from tests.modeling.helpers import TINY_SIZES, randomize


def tiny_model(class_name: str, config_name: str, **overrides) -> torch.nn.Module:
    """A random transformers `class_name` (e.g. Qwen2ForSequenceClassification) of a tiny `config_name` config."""
    config = getattr(transformers, config_name)(**{**TINY_SIZES, **overrides})
    return randomize(getattr(transformers, class_name)(config))


def save_sentence_transformers_pooling(folder: str, mode: str, normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers writes them (mode: mean_tokens, lasttoken,
    cls_token)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    switches = {f"pooling_mode_{m}": m == mode for m in modes}
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": TINY_SIZES["hidden_size"], **switches}, f)


class RewardModel(torch.nn.Module):
    """Qwen2.5-Math-RM's layout (its remote code): a Qwen2 decoder and a two-layer `score` MLP on the last token."""

    def __init__(self, **overrides) -> None:
        super().__init__()
        config = transformers.Qwen2Config(**{**TINY_SIZES, **overrides})
        self.model = transformers.Qwen2Model(config)
        hidden = config.hidden_size
        self.score = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.config = config
        randomize(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.score(self.model(input_ids).last_hidden_state)[:, -1]

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(folder, "model.safetensors"))
        config = self.config.to_dict()
        config["architectures"] = ["Qwen2ForRewardModel"]
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)


def hf_pooled(model: torch.nn.Module, ids: list[int], pooling: str = "last", normalize: bool = False) -> torch.Tensor:
    """transformers' answer for one prompt: a classifier's logits, a reward, or a bare decoder's pooled state."""
    with torch.no_grad():
        inputs = torch.tensor([ids])
        if isinstance(model, RewardModel):
            return model(inputs)[0]
        out = model(inputs)
        if hasattr(out, "logits"):
            return out.logits[0]
        hidden = out.last_hidden_state[0]
        pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
        return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled
