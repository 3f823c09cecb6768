"""Stream tensors out of a folder of safetensors files (single file or sharded with an index)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tgi_compat.modeling.weights.lazy import SafetensorsSlice

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's shard files, in index order when there is an index."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return [os.path.join(folder, n) for n in names]


def iterate_safetensors(
    folder: str, show_progress: bool = True, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | SafetensorsSlice]]:
    """Yield (name, tensor) one at a time, so peak host memory stays at one tensor. lazy: yield
    SafetensorsSlice instead, valid until the next item, from which a rank reads only its part."""
    files = safetensors_files(folder)
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not show_progress) as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, (SafetensorsSlice(f.get_slice(name)) if lazy else f.get_tensor(name))
                    bar.update(1)
