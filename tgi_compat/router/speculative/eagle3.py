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


MAX_WAITING_ROWS = 8192  # hidden rows a request keeps for the head before the oldest go


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
        # target hidden rows not in the cache yet, as (first position, rows) segments: views of each step's copy,
        # joined once when drafting (a request that does not draft for a while costs no copy per step)
        self._waiting: list[tuple[int, torch.Tensor]] = []
        self._num_waiting = 0

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, 3 * H] of positions start..start + n - 1, computed by the last step."""
        keep = bisect.bisect_left(self._kv_positions, start)
        if keep < len(self._kv_positions):  # recomputed from `start` on: what was cached there is stale
            self._kv, self._kv_positions = self._kv.first(keep), self._kv_positions[:keep]
        waiting = [(first, rows[: start - first]) for first, rows in self._waiting if first < start]
        if waiting and waiting[-1][0] + waiting[-1][1].shape[0] != start:
            waiting = []  # a gap (positions never computed): the head drafts from what comes after it
        waiting.append((start, hidden))
        self._num_waiting = sum(rows.shape[0] for _, rows in waiting)
        while self._num_waiting > MAX_WAITING_ROWS:  # (a request not drafting for long keeps its latest rows)
            self._num_waiting -= waiting.pop(0)[1].shape[0]
        self._waiting = waiting

    @torch.inference_mode()
    def propose(self, max_tokens: int) -> list[int]:
        last = len(self._tokens) - 2  # the newest position whose next token is known
        if max_tokens <= 0 or not self._waiting:
            return []
        first, end = self._waiting[0][0], self._waiting[-1][0] + self._waiting[-1][1].shape[0]
        if not first <= last < end:
            return []  # no hidden state of position N - 2 (nothing computed since the last proposal)
        head, waiting = self.head, torch.cat([rows for _, rows in self._waiting])[: last + 1 - first]
        positions = torch.arange(first, last + 1, device=waiting.device)
        ids = torch.tensor(self._tokens[first + 1 : last + 2], device=waiting.device)
        logits, hidden, new = head(ids, positions, waiting, self._kv, from_target=True)
        self._kv = self._kv.joined(new)
        self._kv_positions += range(first, last + 1)
        self._waiting, self._num_waiting = [], 0
        token = head.to_target_ids(logits[-1:].argmax(-1))
        drafts, hidden, kv = [token], hidden[-1:], self._kv
        for position in range(last + 1, last + max_tokens):  # each draft and the head's own output: the next
            logits, hidden, new = head(token, positions.new_tensor([position]), hidden, kv, from_target=False)
            kv = kv.joined(new)
            token = head.to_target_ids(logits.argmax(-1))
            drafts.append(token)
        return torch.cat(drafts).tolist()  # (one device-to-host copy for all of them)
