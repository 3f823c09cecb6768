"""What the sampler hands back: a step's chosen ids, their logprobs and top-n, on their way to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_compat.modeling import copy_streams
from tgi_compat.router.outputs import TopToken
from tgi_compat.router.step import SampledToken


@dataclass(slots=True)
class TopAlternatives:
    """Each row's top-n alternatives, ties with the n-th kept (top_n_with_ties)."""

    ids: torch.Tensor  # [B, K]
    logprobs: torch.Tensor  # [B, K]
    counts: torch.Tensor  # [B] int64: how many alternatives each row reports


@dataclass(slots=True)
class SamplerOutput:
    """Device tensors of one step, packed for a single device-to-host copy."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, or float64 where the choice packed them (a view of `packed`)
    top: TopAlternatives | None  # only when some row asked for top-n tokens
    all_logprobs: torch.Tensor  # [B, V], read again only when ties overflow the top_ids columns (with top-n)
    packed: torch.Tensor | None = None  # [2, B] float64 ids and logprobs, where the choice wrote them so

    def to_host(self) -> list[SampledToken]:
        return self.start_copy().rows()

    def start_copy(self) -> SampledRows:
        """Start the step's one device-to-host copy; SampledRows.rows() waits for it."""
        if self.top is None:  # the usual step: ids and logprobs only
            packed = self.packed
            if packed is None:
                packed = torch.stack([self.token_ids.to(torch.float64), self.logprobs.to(torch.float64)])  # [2, B]
        else:
            parts = [self.token_ids, self.logprobs, self.top.counts, self.top.ids, self.top.logprobs]
            num_rows = self.token_ids.shape[0]
            packed = torch.cat([p.reshape(num_rows, -1).to(torch.float64) for p in parts], dim=1)  # [B, 3 + 2K]
        return SampledRows(self, DeviceToHost(packed))

    def to_token(self, i: int, values: list[float]) -> SampledToken:
        token = SampledToken(int(values[0]), values[1])
        if self.top is None or (count := int(values[2])) == 0:
            return token
        width = self.top.ids.shape[1]
        if count > width:  # rare: more ties than fetched columns; a second copy for this row only
            row_values, row_ids = self.all_logprobs[i].topk(count)
            pairs = zip(row_ids.tolist(), row_values.tolist())
        else:
            pairs = zip(values[3 : 3 + count], values[3 + width : 3 + width + count])
        token.top_tokens = [TopToken(int(t), float(v)) for t, v in pairs]
        return token


class DeviceToHost:
    """A device tensor's copy to the host, started at once and read later: into pinned memory on a
    GPU, on a side stream, so that neither the host nor the work queued after it waits for the copy."""

    def __init__(self, values: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if values.device.type != "cuda":
            self._host = values
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._ready = copy_streams.download(values, self._host)

    def tolist(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


@dataclass(slots=True)
class SampledRows:
    """A step's sampled rows on their way to the host."""

    output: SamplerOutput
    copy: DeviceToHost

    def rows(self) -> list[SampledToken]:
        """Plain Python objects per row; waits for the copy."""
        values = self.copy.tolist()
        if self.output.top is None:
            ids, logprobs = values
            return list(map(SampledToken, map(int, ids), logprobs))
        return [self.output.to_token(i, row) for i, row in enumerate(values)]
