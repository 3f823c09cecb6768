"""Hub ids -> a local snapshot folder, through huggingface_hub's cache (HF_HOME, HF_HUB_OFFLINE)."""

from __future__ import annotations

import os

# What a model needs at runtime: weights, configs, tokenizer files. Never .bin/.pt/.h5 duplicates.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.tiktoken", "*.jinja", "*.txt"]


class ModelNotFoundError(FileNotFoundError):
    pass


def _cache_dir() -> str | None:
    # TGI's images set HUGGINGFACE_HUB_CACHE=/data; huggingface_hub itself reads HF_HUB_CACHE/HF_HOME.
    return os.environ.get("HUGGINGFACE_HUB_CACHE") or None


def download_snapshot(repo_id: str, revision: str | None = None) -> str:
    """Local folder of the snapshot; downloads unless offline. Raises ModelNotFoundError clearly."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    # Read at call time: huggingface_hub only reads HF_HUB_OFFLINE once, when first imported.
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            cache_dir=_cache_dir(),
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as exc:
        reason = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else "it could not be downloaded"
        raise ModelNotFoundError(f"model {repo_id!r} (revision {revision or 'main'}) not found: {reason}") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelNotFoundError(f"model {repo_id!r} (revision {revision or 'main'}) not found: {exc}") from exc
