"""A PEFT LoRA adapter read from its folder: adapter_config.json + adapter_model.safetensors.

Only what serving needs is kept: per (layer, projection) the pair A [r, in] and B [out, r], with B already
multiplied by the adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA), so that the delta is
x @ A^T @ B^T. A fused checkpoint's pair (Phi-3's qkv_proj) stays whole here; the model's part sizes cut it.
Anything PEFT can express that we cannot serve (DoRA, trained biases, modules_to_save, embedding or LM-head LoRA)
is refused with a LoraAdapterError naming it, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# Our projection names, in the checkpoint's (and PEFT's) spelling.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A fused checkpoint's (Phi-3): one pair over several of them, cut by output when it is staged (LoraManager.prepare)
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_WEIGHTS_FILE = "adapter_model.safetensors"
_CONFIG_FILE = "adapter_config.json"


class LoraAdapterError(ValueError):
    """An adapter that cannot be loaded: missing files, a malformed config or tensors, unsupported features."""


class LoraAdapterNotFoundError(LoraAdapterError):
    """Nothing at the adapter's path, and no such adapter on the hub."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], scaling folded in

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    name: str
    source: str  # the folder or hub id it came from
    rank: int  # the largest rank among its modules
    modules: dict[tuple[int, str], LoraModule]  # (layer, projection) -> its pair
    base_model: str | None = None  # adapter_config's base_model_name_or_path

    @property
    def num_layers(self) -> int:
        return 1 + max(layer for layer, _ in self.modules)


def resolve_adapter_folder(source: str, revision: str | None = None) -> str:
    """A local folder, or a hub id fetched through huggingface_hub (only the adapter's two files)."""
    if os.path.isdir(source):
        return source
    if os.path.exists(source):
        raise LoraAdapterError(f"LoRA adapter {source!r} is not a folder")
    if source.startswith(("/", ".")):
        raise LoraAdapterNotFoundError(f"LoRA adapter {source!r}: no such folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(
            source,
            revision=revision,
            allow_patterns=[_CONFIG_FILE, _WEIGHTS_FILE],
            local_files_only=offline,
            cache_dir=os.environ.get("HUGGINGFACE_HUB_CACHE") or None,
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise LoraAdapterNotFoundError(
            f"LoRA adapter {source!r} is neither a local folder nor reachable on the hub: {exc}"
        ) from None


def load_peft_adapter(name: str, source: str, revision: str | None = None) -> PeftAdapter:
    """Read and check one adapter (tensors on the CPU, in float32: they are cast when copied into a slot)."""
    folder = resolve_adapter_folder(source, revision)
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    alphas: dict[tuple[int, str], float] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in (*PROJECTIONS, *FUSED_PROJECTIONS):
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: unsupported tensor {key!r} "
                f"(LoRA on {', '.join((*PROJECTIONS, *FUSED_PROJECTIONS))} only)"
            )
        where = (int(match.group(1)), match.group(2))
        pairs.setdefault(where, {})[match.group(3)] = tensor
        alphas[where] = _alpha(config, key[: match.end(2)].removeprefix("base_model.model."))
    rslora = bool(config.get("use_rslora", False))
    modules = {}
    for (layer, projection), pair in sorted(pairs.items()):
        alpha = alphas[(layer, projection)]
        modules[(layer, projection)] = _module(name, f"layers.{layer}.{projection}", pair, alpha, rslora)
    if not modules:
        raise LoraAdapterError(f"LoRA adapter {name!r} has no LoRA weights in {_WEIGHTS_FILE}")
    rank = max(module.rank for module in modules.values())
    return PeftAdapter(name, source, rank, modules, config.get("base_model_name_or_path"))


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, _CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoraAdapterError(f"no {_CONFIG_FILE} in {folder}") from None
    except json.JSONDecodeError as exc:
        raise LoraAdapterError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{path} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": config.get("use_dora"),  # a magnitude vector per module: not a low-rank sum
        "modules_to_save": config.get("modules_to_save"),  # fully trained modules (often lm_head)
    }
    for key, value in refused.items():
        if value:
            raise LoraAdapterError(f"{path}: {key}={value!r} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"{path}: bias={config.get('bias')!r} is not supported (only 'none')")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise LoraAdapterError(f"{path}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def _alpha(config: dict, module: str) -> float:
    """The module's lora_alpha: alpha_pattern's first key that ends its name at a dot (as peft matches it; a
    module's rank is its tensors', which rank_pattern shaped), else the adapter's."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config["lora_alpha"])


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(folder, _WEIGHTS_FILE)
    if not os.path.exists(path):
        found = ", ".join(sorted(os.listdir(folder))) or "nothing"
        raise LoraAdapterError(f"no {_WEIGHTS_FILE} in {folder} (found: {found}); save it with safe_serialization")
    try:
        return load_file(path)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise LoraAdapterError(f"{path} is not a readable safetensors file: {exc}") from None


def _module(name: str, where: str, pair: dict[str, torch.Tensor], alpha: float, rslora: bool) -> LoraModule:
    if set(pair) != {"A", "B"}:
        missing = "lora_B" if "A" in pair else "lora_A"
        raise LoraAdapterError(f"LoRA adapter {name!r}: {where} has no {missing}")
    a, b = pair["A"], pair["B"]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
            "expected [r, in] and [out, r]"
        )
    rank = a.shape[0]
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    return LoraModule(a.float().contiguous(), (b.float() * scale).contiguous())
