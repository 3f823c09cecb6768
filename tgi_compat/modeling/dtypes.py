"""The runner's dtypes: the serving dtype from --dtype (auto: bfloat16 on CUDA, float32 on the CPU), the KV cache's
from --kv-cache-dtype (auto: the model's; fp8 variants), and the default dtype a model is built under."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (choose float32, float16 or bfloat16)")
    return _DTYPES[name]


def resolve_kv_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    if name is None or name == "auto":
        return model_dtype
    if name not in _KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r} (choose auto, {', '.join(_KV_CACHE_DTYPES)})")
    return _KV_CACHE_DTYPES[name]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
