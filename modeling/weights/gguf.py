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

from modeling.weights.gguf_dequant import dequantize_tensor
from modeling.weights.gguf_file import GGUFFile

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
    reader: GGUFFile, num_heads: int, num_kv_heads: int, show_progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor, dequantized one at a time."""
    gguf_arch = reader.fields["general.architecture"]
    is_llama = gguf_arch == "llama"
    for tensor in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", disable=not show_progress):
        # GGUF lists dims fastest-first; reversed they are the torch shape.
        weights = dequantize_tensor(tensor.data, tensor.type_name, tensor.shape)
        if is_llama and ".attn_q." in tensor.name:
            weights = unpermute_rotary_rows(weights, num_heads)
        elif is_llama and ".attn_k." in tensor.name:
            weights = unpermute_rotary_rows(weights, num_kv_heads)
        elif gguf_arch in _GEMMA_ARCHS and tensor.name.endswith("norm.weight"):
            weights = weights - 1
        yield hf_tensor_name(tensor.name, gguf_arch), weights
