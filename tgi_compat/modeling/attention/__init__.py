"""Attention backends. `create_backend` picks one by name, once at startup.

Every backend is built from one `AttentionShape` (heads, head size, request rows, device, dtype).
"""

from __future__ import annotations

import torch

from tgi_compat.modeling.attention.base import AttentionBackend, AttentionShape


def default_backend_name(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def create_backend(name: str | None, shape: AttentionShape) -> AttentionBackend:
    name = name or default_backend_name(shape.device)
    backend_cls: type[AttentionBackend]
    if name == "torch":
        from tgi_compat.modeling.attention.torch_backend import TorchAttentionBackend

        backend_cls = TorchAttentionBackend
    elif name == "triton":
        from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend

        backend_cls = TritonAttentionBackend
    else:
        raise ValueError(f"unknown attention backend {name!r} (choose 'torch' or 'triton')")
    return backend_cls(shape)
