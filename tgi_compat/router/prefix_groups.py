"""Which rows of a decode step share a KV prefix (--diverse_mode): the groups of the shared-prefix kernel.

n / best_of siblings run on one prompt's cached prefix, a locked path of the prefix cache's tree
(tgi_compat/router/prefix_cache.py) that their req_to_token rows hold slot for slot. Each row is anchored at the
deepest node of its path that another running request also locks (`PrefixMatch.shared_node`): rows anchored at one
node share its `depth` leading slots. The prompt's node, for siblings; a common system prompt's, for requests that
share only that. A few attribute reads per row: nothing on the step's host path scans a prompt.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


def shared_prefix_groups(
    anchors: Sequence[tuple[Hashable, int] | None], group_max: int, min_shared: int = 1
) -> list[tuple[int, list[int]]]:
    """anchors[i]: batch row i's (anchor node, its depth), None for a row that shares nothing. Returns (shared
    length, batch positions) of each group of two to `group_max` rows on one anchor of depth >= `min_shared`, in
    batch order (the first position leads); an anchor's rows past a multiple of `group_max` make further groups."""
    by_anchor: dict[Hashable, list[int]] = {}
    depths: dict[Hashable, int] = {}
    for position, anchor in enumerate(anchors):
        if anchor is not None and anchor[1] >= min_shared:
            by_anchor.setdefault(anchor[0], []).append(position)
            depths[anchor[0]] = anchor[1]
    groups = []
    for key, positions in by_anchor.items():
        for start in range(0, len(positions), group_max):
            members = positions[start : start + group_max]
            if len(members) >= 2:
                groups.append((depths[key], members))
    return groups


@dataclass
class GroupCounts:
    """Cumulative, over the decode steps grouped so far: what the engine reports (EngineStats.diverse_*), so a
    benchmark can tell that siblings really decoded as groups."""

    steps: int = 0
    rows: int = 0  # the steps' rows
    grouped_rows: int = 0  # of which in a group
    groups: int = 0
    largest: int = 0  # rows of the largest group seen

    def add(self, groups: list[tuple[int, list[int]]], batch_size: int) -> None:
        self.steps += 1
        self.rows += batch_size
        self.grouped_rows += sum(len(members) for _, members in groups)
        self.groups += len(groups)
        self.largest = max([self.largest, *(len(members) for _, members in groups)])
