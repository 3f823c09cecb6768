"""TGI's Medusa-style detection, for EAGLE-3 heads: `--model-id HEAD [--speculate k]` serves the base model the
head's config.json names, drafting with the head. TGI's server does this for Medusa (`medusa_num_heads` and
`base_model_name_or_path` in config.json) and MLP speculators (`n_predict`): the model id becomes the base model's,
so the tokenizer, chat template and /info's model_id are the base model's too.

The base model: speculators' `speculators_config.verifier.name_or_path`, else `base_model_name_or_path` (Medusa's key,
which EAGLE-format heads may carry). The head's config.json is read where it is on disk: a local folder, or a hub id
already in the hub cache (the launcher never goes to the network to read a plain model's config).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# drafts per step where neither --speculate nor the head's config gives a number (SGLang's and the EAGLE-3
# paper's usual chain length)
DEFAULT_DRAFTS = 3


@dataclass(frozen=True, slots=True)
class DetectedHead:
    head: str  # --model-id as given: the head's folder or hub id
    base_model_id: str
    num_speculative_tokens: int

    def speculative_config(self) -> str:
        """The same head as vLLM's --speculative-config JSON."""
        return json.dumps(
            {"method": "eagle3", "model": self.head, "num_speculative_tokens": self.num_speculative_tokens}
        )


def detect_eagle3_head(model_id: str, revision: str | None, speculate: int | None) -> DetectedHead | None:
    """The EAGLE-3 head `model_id` is and the base model it names; None where it is no head. ValueError: a head
    that names no base model, or one that cannot be found."""
    from tgi_compat.modeling.models.eagle3_config import Eagle3Config
    from tgi_compat.modeling.source import resolve_model_source
    from tgi_compat.modeling.weights.hub import ModelNotFoundError

    config = _config_on_disk(model_id, revision)
    if config is None or Eagle3Config.format_of(config) is None:
        return None
    base = _base_model(config)
    if base is None:
        raise ValueError(
            f"--model-id {model_id} is an EAGLE-3 head that names no base model (speculators_config.verifier."
            "name_or_path or base_model_name_or_path): serve the base model with "
            f'--speculative-config \'{{"method": "eagle3", "model": "{model_id}"}}\''
        )
    try:
        resolve_model_source(base)
    except ModelNotFoundError as exc:
        raise ValueError(
            f"--model-id {model_id} is an EAGLE-3 head for base model {base!r}, not found: {exc}"
        ) from None
    proposed = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = speculate or int(proposed[0].get("speculative_tokens") or DEFAULT_DRAFTS)
    return DetectedHead(model_id, base, k)


def _base_model(config: dict[str, Any]) -> str | None:
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") or config.get("base_model_name_or_path") or None


def _config_on_disk(model_id: str, revision: str | None) -> dict[str, Any] | None:
    path = os.path.join(os.path.expanduser(model_id), "config.json")
    if not os.path.isfile(path):
        if model_id.count("/") != 1 or model_id.startswith(("/", ".", "~")):
            return None
        from huggingface_hub import try_to_load_from_cache

        from tgi_compat.modeling.weights.hub import _cache_dir

        cached = try_to_load_from_cache(model_id, "config.json", cache_dir=_cache_dir(), revision=revision)
        if not isinstance(cached, str):
            return None
        path = cached
    with open(path) as f:
        config = json.load(f)
    return config if isinstance(config, dict) else None
