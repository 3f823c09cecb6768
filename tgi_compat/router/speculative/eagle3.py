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
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from tgi_compat.router.speculative.policy import HeadCost

if TYPE_CHECKING:  # (the head's module imports kernels: it is loaded by model_loading only)
    from tgi_compat.modeling.models.eagle3 import DraftKV, Eagle3Head


MAX_WAITING_ROWS = 8192  # hidden rows a request keeps for the head before the oldest go


@dataclass(frozen=True, slots=True)
class Eagle3Drafter:
    """The head every request's proposer shares, and the reader of a step's auxiliary hidden states
    (ModelRunner.aux_hidden.rows: [step tokens, 3 * target hidden], valid until the next forward); `cost`: the
    head's time to draft, measured at startup, which the draft-length policy adds to the step's."""

    head: Eagle3Head
    aux_rows: Callable[[int], torch.Tensor]
    cost: HeadCost


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

    def propose(self, max_tokens: int) -> list[int]:
        return propose_together(self.head, [self], [max_tokens])[0]

    def waiting(self) -> tuple[int, torch.Tensor] | None:
        """(first position, the target's hidden rows of positions first..N - 2) to fold into the cache before
        drafting; None where position N - 2 has none (nothing computed since the last proposal)."""
        last = len(self._tokens) - 2  # the newest position whose next token is known
        if not self._waiting:
            return None
        first, end = self._waiting[0][0], self._waiting[-1][0] + self._waiting[-1][1].shape[0]
        if not first <= last < end:
            return None
        return first, torch.cat([rows for _, rows in self._waiting])[: last + 1 - first]

    def next_tokens(self, first: int, num: int) -> list[int]:
        return self._tokens[first + 1 : first + 1 + num]

    def cache(self) -> DraftKV:
        return self._kv

    def commit(self, first: int, new: DraftKV) -> None:
        """The K/V rows of positions first.. from the target's hidden states: cached; nothing waits any more."""
        self._kv = self._kv.joined(new)
        self._kv_positions += range(first, first + len(new))
        self._waiting, self._num_waiting = [], 0


@torch.inference_mode()
def propose_together(
    head: Eagle3Head, proposers: Sequence[Eagle3Proposer], max_tokens: Sequence[int]
) -> list[list[int]]:
    """Each proposer's drafts (up to max_tokens[i]; [] without a hidden state of its position N - 2), the head run
    over all of them at once: one forward folds every request's waiting rows in (padded to the longest), then
    one forward per draft."""
    from tgi_compat.modeling.models.eagle3 import BatchedKV, DraftKV

    drafts: list[list[int]] = [[] for _ in proposers]
    jobs = [(i, w) for i, p in enumerate(proposers) if max_tokens[i] > 0 and (w := p.waiting()) is not None]
    if not jobs:
        return drafts
    members = [proposers[i] for i, _ in jobs]
    device = jobs[0][1][1].device
    lengths = [rows.shape[0] for _, (_, rows) in jobs]
    pad = max(lengths)
    ids = [p.next_tokens(first, n) + [0] * (pad - n) for p, (_, (first, _)), n in zip(members, jobs, lengths)]
    positions = [list(range(first, first + pad)) for _, (first, _) in jobs]
    hidden = pad_sequence([rows for _, (_, rows) in jobs], batch_first=True)
    num_new = torch.tensor(lengths, device=device)
    cache = BatchedKV.of([p.cache() for p in members])
    as_tensor = partial(torch.tensor, device=device)
    logits, hidden, k, v = head(as_tensor(ids), as_tensor(positions), hidden, cache, num_new, from_target=True)
    for b, (p, (_, (first, _)), n) in enumerate(zip(members, jobs, lengths)):
        p.commit(first, DraftKV(k[b, :n], v[b, :n]))
    every, last_rows = torch.arange(len(jobs), device=device), num_new - 1
    token = head.to_target_ids(logits[every, last_rows].argmax(-1))  # [B]: each request's first draft
    hidden = hidden[every, last_rows][:, None]
    position = as_tensor([first + n for (_, (first, _)), n in zip(jobs, lengths)])  # the first draft's
    cache, one, tokens = BatchedKV.of([p.cache() for p in members]), torch.ones_like(num_new), [token]
    for _ in range(1, max(max_tokens[i] for i, _ in jobs)):  # each draft and the head's own output: the next
        logits, hidden, k, v = head(token[:, None], position[:, None], hidden, cache, one, from_target=False)
        cache, position = cache.appended(k, v), position + 1
        token = head.to_target_ids(logits[:, 0].argmax(-1))
        tokens.append(token)
    table = torch.stack(tokens, 1).tolist()  # (one device-to-host copy for all of them)
    for b, (i, _) in enumerate(jobs):
        drafts[i] = table[b][: max_tokens[i]]
    return drafts
