"""The LoRA flags in each spelling our users bring, into the engine's list of adapters.

TGI: `--lora-adapters id[@revision],name=path,...` (a bare id is its own name). vLLM / AIAK: `--lora-modules
name=path ...`, or each module as JSON `{"name": ..., "path": ..., "base_model_name": ...}`.
"""

from __future__ import annotations

import json

from tgi_compat.router.config import LoraSource


class LoraFlagError(ValueError):
    pass


def parse_tgi_lora_adapters(value: str) -> list[LoraSource]:
    sources = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        name, has_path, path = item.partition("=")
        if has_path:
            sources.append(LoraSource(name, path))
        else:  # a hub id, optionally at a revision, named by its id
            repo, _, revision = item.partition("@")
            sources.append(LoraSource(repo, repo, revision or None))
    return sources


def parse_lora_module(value: str) -> LoraSource:
    if value.lstrip().startswith("{"):
        try:
            module = json.loads(value)
        except json.JSONDecodeError as exc:
            raise LoraFlagError(f"--lora-modules {value!r}: invalid JSON ({exc})") from None
        if (
            not isinstance(module, dict)
            or not isinstance(module.get("name"), str)
            or not isinstance(module.get("path"), str)
        ):
            raise LoraFlagError(f"--lora-modules {value!r}: JSON needs string 'name' and 'path'")
        return LoraSource(module["name"], module["path"])
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise LoraFlagError(f"--lora-modules {value!r}: expected name=path or JSON")
    return LoraSource(name, path)
