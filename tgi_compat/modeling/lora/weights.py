"""One projection's LoRA weights for every adapter slot, in device buffers beside the base layer.

A fused projection (q|k|v, gate|up) has one slice per part: slice s owns rows s*R .. (s+1)*R of the stacked A
(R = --max-lora-rank; an adapter of rank r fills the first r, the rest stay zero) and its own output columns of B.
Under tensor parallelism A and B are cut like the base layer: a column-parallel layer keeps its rows of each
part's B, a row-parallel one its columns of A (its partial output then joins the base's partial sum). Over a plain
or FP8 base the stacked A is the extra rows of the projection's widened twin (folding.py), which decode-sized steps
run; over FP8 its rows are quantized per row when staged, each with its scale.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tgi_compat.kernels.lora.expand import lora_expand, lora_expand_ref
from tgi_compat.kernels.lora.expand_folded import lora_expand_folded, lora_expand_folded_ref
from tgi_compat.kernels.lora.shrink import NO_PROLOGUE, ShrinkPrologue, lora_shrink, lora_shrink_ref
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.quantization.fp8 import dequantize_fp8, quantize_weight_per_channel
from tgi_compat.modeling.lora.adapter import LoraAdapterError, LoraModule
from tgi_compat.modeling.lora.folding import fold
from tgi_compat.modeling.lora.step import LoraStep
from tgi_compat.modeling.parallel import Slice


@dataclass(frozen=True, slots=True)
class FoldPolicy:
    """Which steps run a folded projection (the slots' A under the base weight, then `expand_folded`) rather than the
    base projection and the segmented shrink and expand."""

    max_tokens: int  # steps of at most this many tokens fold (decode batches: a CUDA graph's size decides it once)
    max_share: float  # steps of any size fold where the slots' A rows add at most this share to the output rows

    def folds(self, num_tokens: int, extra_share: float) -> bool:
        return num_tokens <= self.max_tokens or extra_share <= self.max_share


# A 4096-token prefill of an FP8 Llama-3-8B with 8 slots of r = 16 (the rows add 1-6%): 1.20x its base step folded,
# 1.45x through the segmented kernels (H100, session 29).
DEFAULT_FOLDING = FoldPolicy(max_tokens=256, max_share=1 / 8)
NEVER_FOLD = FoldPolicy(max_tokens=0, max_share=-1.0)  # the segmented kernels at every size, as int8 / int4 bases
ALWAYS_FOLD = FoldPolicy(max_tokens=sys.maxsize, max_share=float("inf"))
folding = DEFAULT_FOLDING  # what `LoraWeights.folded_for` applies; benchmarks and tests swap it (`folding_policy`)


@contextmanager
def folding_policy(policy: FoldPolicy) -> Iterator[None]:
    global folding
    previous, folding = folding, policy
    try:
        yield
    finally:
        folding = previous


@dataclass(frozen=True, slots=True)
class LoraSlice:
    projection: str  # the checkpoint's name of this part (q_proj, gate_proj, ...)
    full_out: int  # the checkpoint's output size of the part
    rows: Slice  # the part's output rows this rank keeps
    out_start: int  # where they start in the layer's (this rank's) output


class LoraWeights:
    def __init__(self, proj: Linear, projections: tuple[str, ...], max_loras: int, max_rank: int) -> None:
        self.max_rank = max_rank
        self.full_in = proj.full_in_features
        self.in_columns = proj.in_slice  # row-parallel: this rank's columns of A
        slices, start = [], 0
        for index, projection in enumerate(projections):
            full_out = proj.full_out_sizes[index]
            rows = proj.part_slices[index] if proj.part_slices is not None else Slice(0, full_out)
            slices.append(LoraSlice(projection, full_out, rows, start))
            start += rows.size
        self.slices = tuple(slices)
        self.slice_ends = tuple(part.out_start + part.rows.size for part in slices)  # the expand's column split
        a_shape = (max_loras, len(slices) * max_rank, proj.in_features)
        # a plain or FP8 base: A stacked under its weight (folding.py), so decode-sized steps shrink in the base GEMM
        folded = fold(proj, max_loras * len(slices) * max_rank)
        self.folded = None if folded is None else folded.twin
        self.extra_share = max_loras * len(slices) * max_rank / proj.out_features  # the folded GEMM's added rows
        self.a_scale: torch.Tensor | None = None  # [L, S * R] float32: an FP8 A's per-row scales
        self.fp8_rounded = folded is not None and folded.fp8_rounded
        if folded is not None:
            self.a = folded.a.view(a_shape)
            if folded.a_scale is not None:
                self.a_scale = folded.a_scale.view(a_shape[:2])
        else:  # made under the runner's device and dtype (the model's, even over a quantized base)
            self.a = torch.zeros(a_shape)
        self.b = torch.zeros(max_loras, proj.out_features, max_rank)

    def check(self, adapter: str, layer: int, modules: dict[str, LoraModule]) -> None:
        """Raise LoraAdapterError where an adapter's pair for this projection does not fit it."""
        for part in self.slices:
            module = modules.get(part.projection)
            if module is None:
                continue
            where = f"layers.{layer}.{part.projection}"
            if module.rank > self.max_rank:
                raise LoraAdapterError(
                    f"LoRA adapter {adapter!r}: {where} has rank {module.rank} > --max-lora-rank {self.max_rank}"
                )
            expected = (self.full_in, part.full_out)
            if (module.a.shape[1], module.b.shape[0]) != expected:
                raise LoraAdapterError(
                    f"LoRA adapter {adapter!r}: {where} maps {module.a.shape[1]} -> {module.b.shape[0]} features, "
                    f"the model's {expected[0]} -> {expected[1]} (an adapter for another base model?)"
                )

    def slot_buffers(self, slot: int) -> tuple[torch.Tensor, ...]:
        """The device tensors one slot's adapter fills: A [S * R, in], B [out, R] (and A's row scales [S * R])."""
        scale = () if self.a_scale is None else (self.a_scale[slot],)
        return (self.a[slot], self.b[slot], *scale)

    def stage(self, modules: dict[str, LoraModule]) -> tuple[torch.Tensor, ...]:
        """One adapter's (checked) pairs as this rank's cut of one slot: host tensors shaped and typed as
        slot_buffers', parts it lacks zero (pageable: placement.HostPool packs a whole adapter's into one pinned
        buffer). Over an FP8 base A's rows are quantized per row, as the base's weight rows are."""
        a = torch.zeros(self.a.shape[1:], dtype=torch.float32, device="cpu")
        b = torch.zeros(self.b.shape[1:], dtype=self.b.dtype, device="cpu")
        rank_cap = self.max_rank
        for index, part in enumerate(self.slices):
            module = modules.get(part.projection)
            if module is None:
                continue
            a_part = module.a if self.in_columns is None else module.a[:, self.in_columns.start : self.in_columns.end]
            a[index * rank_cap : index * rank_cap + module.rank] = a_part
            b[part.out_start : part.out_start + part.rows.size, : module.rank] = module.b[
                part.rows.start : part.rows.end
            ]
        if not self.fp8_rounded:
            return a.to(self.a.dtype), b
        quantized, scale = quantize_weight_per_channel(a)
        if self.a_scale is not None:
            return quantized, b, scale
        return dequantize_fp8(quantized, scale).to(self.a.dtype), b  # emulated FP8: rounded, kept dequantized

    def place(self, slot: int, staged: tuple[torch.Tensor, ...]) -> None:
        """Copy a staged adapter into `slot` on the current stream (asynchronous from pinned memory)."""
        for buffer, host in zip(self.slot_buffers(slot), staged, strict=True):
            buffer.copy_(host, non_blocking=True)

    def add_to(
        self, out: torch.Tensor, x: torch.Tensor, step: LoraStep, prologue: ShrinkPrologue = NO_PROLOGUE
    ) -> torch.Tensor:
        """out [T, out] += each LoRA row's prologue(x) @ A^T @ B^T (rows without an adapter unchanged); returns out.
        The prologue is the one the base projection fused (the norm of pre-norm rows, SiLU-and-mul of [gate | up])."""
        shrink, expand = (lora_shrink, lora_expand) if x.is_cuda else (lora_shrink_ref, lora_expand_ref)
        expand(out, shrink(x, self.a, step, prologue, a_scale=self.a_scale), self.b, step, self.slice_ends)
        return out

    def folded_for(self, num_tokens: int) -> Linear | None:
        """The widened twin a step of `num_tokens` runs instead of the projection (then `expand_folded`), None where
        it takes the base projection and `add_to`: a base that does not fold (folding.fold), or prefill sizes where
        the slots' A rows are a large share of the GEMM (every token runs through every slot's rows)."""
        return self.folded if folding.folds(num_tokens, self.extra_share) else None

    def expand_folded(self, full: torch.Tensor, step: LoraStep) -> torch.Tensor:
        """The twin's output [T, out + shrunk] -> [T, out]: each LoRA row's base plus shrunk[slot] @ B^T."""
        expand = lora_expand_folded if full.is_cuda else lora_expand_folded_ref
        return expand(full, step, self.b, self.slice_ends)
