"""Vectorised torch dequantization of the common GGUF block formats (Q4_0, Q4_1, Q8_0, F16, BF16).

gguf's numpy dequantizer is the definition (and the fallback for every other format) but takes
~10 s on a 135M model; these do the same arithmetic, in the same order, on whole tensors at once.
"""

from __future__ import annotations

import numpy as np
import torch

_BLOCK = 32  # elements per block in Q4_0/Q4_1/Q8_0


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # [N, 16] uint8 -> [N, 32]: the 16 low nibbles are elements 0..15, the high ones 16..31
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    # [N, 2] uint8 -> [N, 1] float32
    return raw.contiguous().view(torch.float16).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    return d * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return d * _nibbles(blocks[:, 4:]).float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


_BLOCK_BYTES = {"Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q8_0": (34, _q8_0)}


def dequantize_tensor(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """GGUF tensor bytes -> float32 tensor of `shape` (torch order)."""
    raw = torch.from_numpy(np.array(data))  # a copy: the memory map is read-only
    if type_name == "F32":
        return raw.view(torch.float32).reshape(shape).clone()
    if type_name == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    if type_name == "BF16":
        return raw.view(torch.bfloat16).float().reshape(shape)
    if type_name in _BLOCK_BYTES:
        block_bytes, dequant = _BLOCK_BYTES[type_name]
        return dequant(raw.reshape(-1, block_bytes)).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(data, GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
