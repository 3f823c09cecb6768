"""The attention seam: one object per model, chosen once at startup (torch or triton).

Shapes: q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim] for the new tokens;
kv buffers per layer [num_slots, num_kv_heads, head_dim]; req_to_token [max_rows, max_len] int32.

Each call carries its layer's AttentionParams: the scale and the per-layer switches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.layers.ops import LayerOps, RopeTables


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's attention switches, built once with the layer and passed on every call."""

    scale: float
    sliding_window: int | None = None  # a query at position p sees keys (p - sliding_window, p]
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    # chunked local attention (Llama 4): a query at position p sees keys [p // chunk * chunk, p]
    attention_chunk: int | None = None


@dataclass(frozen=True, slots=True)
class LayerQKV:
    """One layer's new tokens on their way into attention, and where their k/v go."""

    qk: torch.Tensor  # [T, H + H_kv, D]: q heads, then k heads, not yet rotated
    v: torch.Tensor  # [T, H_kv, D]
    rope: RopeTables  # this step's rotary tables, made by `ops`
    ops: LayerOps
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @property
    def num_q_heads(self) -> int:
        return self.qk.shape[1] - self.v.shape[1]


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What a backend is built for: one model's heads, the runner's request rows, one device and dtype."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_rows: int
    max_seq_len: int
    device: torch.device
    dtype: torch.dtype
    # --diverse_mode: rows per shared-prefix group that decode steps bring (ForwardBatch.prefix_groups); 0: off
    prefix_group_max: int = 0


class AttentionBackend(ABC):
    # True when a decode step through this backend can be captured as a CUDA graph and replayed:
    # no host syncs, no allocations, fixed-size index tensors per batch size.
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, shape: AttentionShape) -> None:
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.max_rows = shape.max_rows
        self.device = torch.device(shape.device)
        self.dtype = shape.dtype

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> None:
        """Once per step, before the first layer: build whatever index tensors the kernels need."""

    def compile_kernels(
        self,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        req_to_token: torch.Tensor,
        layer_params: list[AttentionParams],
        image_spans: bool = False,
    ) -> None:
        """At start-up: compile the kernel variants the steps may select that the CUDA-graph capture and
        the server's warm-up requests do not reach (a JIT compile met mid-serving stalls every request).
        `image_spans`: the model's prefill steps may open bidirectional image spans (the warm-up sends no image).
        Nothing to do for backends without JIT kernels."""
        return None

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Write the new tokens' k/v into their slots (batch.out_slots)."""

    def rotate_and_store_kv(self, new: LayerQKV) -> torch.Tensor:
        """Rotary on new.qk, then k and v into the KV cache; returns the rotated qk. Backends may fuse the two."""
        qk = new.ops.rotary(new.qk, new.rope)
        self.store_kv(qk[:, new.num_q_heads :], new.v, new.k_cache, new.v_cache)
        return qk

    def rotate_store_and_attend(self, new: LayerQKV, params: AttentionParams) -> torch.Tensor:
        """rotate_and_store_kv, then forward over the rotated q heads: [T, H, D]. Backends may fuse all
        three (new.qk is then left unrotated: nothing reads it after this call)."""
        qk = self.rotate_and_store_kv(new)
        return self.forward(qk[:, : new.num_q_heads], new.k_cache, new.v_cache, params)

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, params: AttentionParams
    ) -> torch.Tensor:
        """Causal attention of the new tokens over their request's KV; returns [T, num_heads, head_dim]."""
