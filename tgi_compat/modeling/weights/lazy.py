"""Checkpoint tensors that are read only in the part a tensor-parallel rank keeps.

With `--num-shard N` the weight iterators yield these instead of tensors, and each parameter's
weight_loader asks for its slice (`take`): a rank reads about 1/N of the large matrices from disk,
never the whole checkpoint. Without sharding the iterators yield plain tensors and nothing here runs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LazyTensor(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Only this range along dim, read and materialised (on the CPU)."""
        ...

    def materialize(self) -> torch.Tensor: ...


def take(loaded: torch.Tensor | LazyTensor, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
    """The whole tensor (dim None), or its range [start, start + length) along dim."""
    if dim is None:
        return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()
    return loaded.narrow(dim, start, length)


class SafetensorsSlice:
    """A tensor of an open safetensors file, read through get_slice (only the bytes asked for)."""

    def __init__(self, file_slice) -> None:
        self._slice = file_slice
        self.shape = tuple(file_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def materialize(self) -> torch.Tensor:
        return self._slice[:]


class NarrowedTensor:
    """A range along one dim of a lazy tensor, itself lazy: a checkpoint tensor that fuses several
    (Phi-3's q|k|v) is cut into its parts without reading it; each rank then reads its slice of a part."""

    def __init__(self, base: LazyTensor, dim: int, start: int, length: int) -> None:
        self._base, self._dim, self._start = base, dim, start
        self.shape = tuple(length if d == dim else size for d, size in enumerate(base.shape))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == self._dim:
            return self._base.narrow(dim, self._start + start, length)
        return self.materialize().narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        return self._base.narrow(self._dim, self._start, self.shape[self._dim])


def narrow(loaded: torch.Tensor | LazyTensor, dim: int, start: int, length: int) -> torch.Tensor | LazyTensor:
    """A range of a tensor, lazy when the tensor is (nothing is read until a loader takes it)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    return NarrowedTensor(loaded, dim, start, length)
