"""EAGLE-3 drafts: a request's proposer runs the draft head (tgi_compat/modeling/models/eagle3.py) on the target's
hidden states of its positions, then on its own output, one draft token at a time.

The head's input at position p is (token p + 1, the target's hidden states at p). Every step hands each request's
hidden rows over (`observe`, from the step's auxiliary hidden states); they wait until the token after them is
known, and are folded into the head's K/V cache when the request next drafts (`propose`): the newest of them, at
position N - 2 of a sequence of N tokens, gives the first draft; each draft and the head's pre-norm output then
give the next. The drafts' own K/V rows are thrown away after proposing: the target's hidden states of the
positions verification keeps replace them.

A step recomputes positions from its first one on (a verify chunk after rejected drafts, a preempted request's
prefill again): `observe` drops the cached K/V and waiting rows from there. Positions never computed (a prefix-cache
hit) leave the head without their context: drafts get worse, the output does not change.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (the head's module imports kernels: it is loaded by model_loading only)
    from tgi_compat.modeling.models.eagle3 import DraftKV, Eagle3Head


@dataclass(frozen=True, slots=True)
class Eagle3Drafter:
    """The head every request's proposer shares, and the reader of a step's auxiliary hidden states
    (ModelRunner.aux_hidden.rows: [step tokens, 3 * target hidden], valid until the next forward)."""

    head: Eagle3Head
    aux_rows: Callable[[int], torch.Tensor]


class Eagle3Proposer:
    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self._tokens: list[int] = []
        self._kv: DraftKV = head.empty_kv()
        self._kv_positions: list[int] = []  # the position of each cached K/V row (ascending)
        self._waiting: torch.Tensor | None = None  # target hidden rows of positions _waiting_start..
        self._waiting_start = 0

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, 3 * H] of positions start..start + n - 1, computed by the last step."""
        keep = bisect.bisect_left(self._kv_positions, start)
        if keep < len(self._kv_positions):  # recomputed from `start` on: what was cached there is stale
            self._kv, self._kv_positions = self._kv.first(keep), self._kv_positions[:keep]
        waiting, first = self._waiting, self._waiting_start
        if waiting is not None and first <= start <= first + waiting.shape[0]:
            self._waiting = torch.cat((waiting[: start - first], hidden))
        else:
            self._waiting, self._waiting_start = hidden, start

    @torch.inference_mode()
    def propose(self, max_tokens: int) -> list[int]:
        last = len(self._tokens) - 2  # the newest position whose next token is known
        waiting, first = self._waiting, self._waiting_start
        if max_tokens <= 0 or waiting is None or not first <= last < first + waiting.shape[0]:
            return []  # no hidden state of position N - 2 (nothing computed since the last proposal)
        head, device = self.head, waiting.device
        positions = torch.arange(first, last + 1, device=device)
        ids = torch.tensor(self._tokens[first + 1 : last + 2], device=device)
        logits, hidden, new = head(ids, positions, waiting[: last + 1 - first], self._kv, from_target=True)
        self._kv = self._kv.joined(new)
        self._kv_positions += range(first, last + 1)
        self._waiting = None
        token = head.to_target_ids(logits[-1:].argmax(-1))
        drafts, hidden, kv = [token], hidden[-1:], self._kv
        for position in range(last + 1, last + max_tokens):  # each draft and the head's own output: the next
            logits, hidden, new = head(token, positions.new_tensor([position]), hidden, kv, from_target=False)
            kv = kv.joined(new)
            token = head.to_target_ids(logits.argmax(-1))
            drafts.append(token)
        return torch.cat(drafts).tolist()  # (one device-to-host copy for all of them)
