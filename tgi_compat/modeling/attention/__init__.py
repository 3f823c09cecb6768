"""Attention backends. `create_backend` picks one by name, once at startup.

Every backend takes the same constructor arguments:
    (num_heads, num_kv_heads, head_dim, max_rows, max_seq_len, device, dtype)
"""

from __future__ import annotations

import torch

from tgi_compat.modeling.attention.base import AttentionBackend


def default_backend_name(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def create_backend(
    name: str | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_rows: int,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionBackend:
    name = name or default_backend_name(device)
    backend_cls: type[AttentionBackend]
    if name == "torch":
        from tgi_compat.modeling.attention.torch_backend import TorchAttentionBackend

        backend_cls = TorchAttentionBackend
    elif name == "triton":
        from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend

        backend_cls = TritonAttentionBackend
    else:
        raise ValueError(f"unknown attention backend {name!r} (choose 'torch' or 'triton')")
    return backend_cls(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_rows=max_rows,
        max_seq_len=max_seq_len,
        device=device,
        dtype=dtype,
    )
