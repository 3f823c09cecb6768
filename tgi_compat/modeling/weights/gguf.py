"""Read a GGUF file: its metadata as a plain dict and its tensors dequantized, under HF names.

llama.cpp's converter permutes the rows of q_proj/k_proj for Llama-family models (it interleaves
the two rotary halves of each head); we undo that exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from tgi_compat.modeling.weights.gguf_dequant import dequantize_tensor
from tgi_compat.modeling.weights.gguf_file import GGUFFile, GGUFTensorInfo

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2/3 norm before and after each sub-block: ffn_norm is the pre-MLP norm there, not Llama's.
_SANDWICH_NORM_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_SANDWICH_NORM_ARCHS = {"gemma2", "gemma3"}
# llama.cpp stores Gemma's norm weights as 1 + w; HF names carry w (as transformers' GGUF loader undoes)
_GEMMA_ARCHS = {"gemma", "gemma2", "gemma3"}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.lru_cache(maxsize=1)
def open_gguf(path: str) -> GGUFFile:
    """One parsed header per file; config and weight loading share it."""
    return GGUFFile(path)


def read_gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Key/value fields as Python values (the large tokenizer arrays are left out, so a missing
    `<arch>.vocab_size` is filled in from the embedding table's rows)."""
    fields = dict(reader.fields)
    vocab_key = f"{fields['general.architecture']}.vocab_size"
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if vocab_key not in fields and embedding is not None:
        fields[vocab_key] = embedding.shape[0]  # torch order: [vocab, hidden]
    return fields


def has_output_tensor(reader: GGUFFile) -> bool:
    return any(t.name == "output.weight" for t in reader.tensors)


def hf_tensor_name(gguf_name: str, gguf_arch: str = "llama") -> str:
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        names = {**_BLOCK_TENSORS, **_SANDWICH_NORM_TENSORS} if gguf_arch in _SANDWICH_NORM_ARCHS else _BLOCK_TENSORS
        if kind not in names:
            raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{names[kind]}.{suffix}"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem not in _TOP_TENSORS:
        raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_TOP_TENSORS[stem]}.{suffix}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation: per head, [D/2, 2] -> [2, D/2] row order."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def iterate_gguf(
    reader: GGUFFile, num_heads: int, num_kv_heads: int, show_progress: bool = True, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFRows]]:
    """Yield (HF name, float32 tensor) for every tensor, dequantized one at a time. lazy: yield
    GGUFRows instead, from which a tensor-parallel rank dequantizes only its rows."""
    gguf_arch = reader.fields["general.architecture"]
    is_llama = gguf_arch == "llama"
    for tensor in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", disable=not show_progress):
        rotary_heads = None
        if is_llama and ".attn_q." in tensor.name:
            rotary_heads = num_heads
        elif is_llama and ".attn_k." in tensor.name:
            rotary_heads = num_kv_heads
        # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
        is_gemma_norm = gguf_arch in _GEMMA_ARCHS and tensor.name.endswith("norm.weight")
        rows = GGUFRows(tensor, rotary_heads, subtract_one=is_gemma_norm)
        yield hf_tensor_name(tensor.name, gguf_arch), (rows if lazy else rows.materialize())


# elements and bytes of one quantization block, for the formats whose columns can be cut block-wise
_COLUMN_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}


class GGUFRows:
    """One GGUF tensor, dequantized on demand. A row of a matrix is contiguous in the file (blocks
    run along it), so a range of rows reads only its own bytes, and a range of columns that starts
    and ends on block boundaries only its blocks of each row; other slices dequantize it all."""

    def __init__(self, tensor: GGUFTensorInfo, rotary_heads: int | None = None, subtract_one: bool = False) -> None:
        self.tensor = tensor
        self.shape = tensor.shape
        self.rotary_heads = rotary_heads  # q/k: rows were permuted per head by llama.cpp's converter
        self.subtract_one = subtract_one  # 1-D norm weights only: they never take the sliced paths

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 1 and len(self.shape) == 2 and self.rotary_heads is None:
            return self._columns(start, length)
        if dim != 0 or len(self.shape) < 2:
            return self.materialize().narrow(dim, start, length)
        t = self.tensor
        raw = t.data.reshape(self.shape[0], -1)[start : start + length]
        weights = dequantize_tensor(raw, t.type_name, (length, *self.shape[1:]))
        if self.rotary_heads is not None:  # whole heads: the per-head un-permutation commutes
            head_dim = self.shape[0] // self.rotary_heads
            weights = unpermute_rotary_rows(weights, length // head_dim)
        return weights

    def _columns(self, start: int, length: int) -> torch.Tensor:
        block = _COLUMN_BLOCKS.get(self.tensor.type_name)
        if block is None or start % block[0] or length % block[0]:
            return self.materialize().narrow(1, start, length)
        elements, block_bytes = block
        raw = self.tensor.data.reshape(self.shape[0], -1)
        raw = raw[:, start // elements * block_bytes : (start + length) // elements * block_bytes]
        return dequantize_tensor(raw, self.tensor.type_name, (self.shape[0], length))

    def materialize(self) -> torch.Tensor:
        weights = dequantize_tensor(self.tensor.data, self.tensor.type_name, self.shape)
        if self.rotary_heads is not None:
            weights = unpermute_rotary_rows(weights, self.rotary_heads)
        if self.subtract_one:
            weights = weights - 1
        return weights
