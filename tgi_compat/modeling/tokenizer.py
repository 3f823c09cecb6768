"""Tokenizer loading for the API layer (never touches weights).

A folder gives its tokenizer.json/tokenizer_config.json directly. A GGUF file's vocabulary must be
converted by transformers (~20-30 s), so the converted tokenizer is saved once into a cache folder
keyed by the file's name, size and mtime, and later loads read that (< 1 s + import time).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

from tgi_compat.modeling.source import ModelSource, resolve_model_source
from tgi_compat.modeling.weights.loader import load_model_config

logger = logging.getLogger(__name__)

# transformers' placeholder for "no limit" is ~1e30; anything this large means "not set".
_UNSET_MAX_LENGTH = 10**20


@dataclass(frozen=True)
class TokenizerInfo:
    tokenizer: object  # transformers PreTrainedTokenizerFast
    chat_template: str | None
    eos_token_ids: list[int]  # generation_config's list if it has one, else the tokenizer's eos (TGI)
    bos_token_id: int | None
    model_max_length: int  # tokenizer limit if set, else the model's context length
    special_token_ids: frozenset[int]


def load_tokenizer(model_id: str | None = None, revision: str | None = None):
    """A transformers fast tokenizer for --model-id (folder, .gguf file or hub id)."""
    return _load(resolve_model_source(model_id, revision))


def load_tokenizer_info(model_id: str | None = None, revision: str | None = None) -> TokenizerInfo:
    """The tokenizer plus what the API layer needs beside it: chat template, eos/bos, limits."""
    source = resolve_model_source(model_id, revision)
    tokenizer = _load(source)
    context_length = load_model_config(source).max_position_embeddings
    tokenizer_limit = tokenizer.model_max_length or _UNSET_MAX_LENGTH
    return TokenizerInfo(
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
        eos_token_ids=_eos_token_ids(source, tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        model_max_length=context_length if tokenizer_limit >= _UNSET_MAX_LENGTH else int(tokenizer_limit),
        special_token_ids=frozenset(_special_token_ids(tokenizer)),
    )


def _load(source: ModelSource):
    from transformers import AutoTokenizer

    gguf_file = source.gguf_file
    if gguf_file is None:
        return AutoTokenizer.from_pretrained(source.folder)
    cache = gguf_tokenizer_cache_folder(gguf_file)
    if os.path.exists(os.path.join(cache, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cache)
    logger.info("Converting the GGUF tokenizer of %s (cached afterwards in %s)", gguf_file, cache)
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=os.path.basename(gguf_file))
    _save_atomically(tokenizer, cache)
    return tokenizer


def cache_root() -> str:
    if os.environ.get("TGI_COMPAT_CACHE"):
        return os.environ["TGI_COMPAT_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "tgi_compat")
    return os.path.join(os.path.expanduser("~"), ".cache", "tgi_compat")


def gguf_tokenizer_cache_folder(gguf_file: str) -> str:
    stat = os.stat(gguf_file)
    stem = os.path.basename(gguf_file).removesuffix(".gguf")
    return os.path.join(cache_root(), "tokenizers", f"{stem}-{stat.st_size}-{stat.st_mtime_ns}")


def _save_atomically(tokenizer, folder: str) -> None:
    """Write to a temp folder and rename, so a concurrent reader never sees half a tokenizer."""
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".tmp-")
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not cache the converted tokenizer in %s: %s", folder, exc)


def _eos_token_ids(source: ModelSource, tokenizer) -> list[int]:
    path = os.path.join(source.folder, "generation_config.json")
    if not source.is_gguf and os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, list):
            return [int(i) for i in eos]
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _special_token_ids(tokenizer) -> set[int]:
    added_special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added_special | set(tokenizer.all_special_ids)
