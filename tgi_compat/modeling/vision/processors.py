"""The checkpoint's image processor (its preprocessor_config.json), always transformers' Pillow backend.

Where torchvision is installed, transformers picks its torchvision backend by default. That backend resizes with other
arithmetic, so the same request would give other pixels, and other tokens, depending on whether torchvision happens
to be installed. The locked install has no torchvision, so with the backend pinned every install, and the GPU runs of
the benchmarks, serves what the locked install serves."""

from __future__ import annotations

from typing import Any


def image_processor(folder: str) -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder, backend="pil")
