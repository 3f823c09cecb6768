"""Which rows of a decode step share a KV prefix (--diverse_mode): the group table of the shared-prefix kernel.

n / best_of siblings run on one prompt's cached prefix: each request's first `cached_prefix.num_tokens` slots
are a path of the prefix cache's tree (tgi_compat/router/prefix_cache.py), in its req_to_token row as they are in
the tree. A slot names one position of the tree, so two such paths that hold the same slot at position k hold the
same slots at every position before k: their shared length is found by bisection on one slot compare, with no
list scans on the step's host path.
"""

from __future__ import annotations

from collections.abc import Sequence


def shared_prefix_groups(
    prefixes: Sequence[Sequence[int]], group_max: int, min_shared: int = 1
) -> list[tuple[int, list[int]]]:
    """prefixes[i]: batch row i's tree-owned slots (empty: none). Returns (shared length, batch positions) of
    each group of at least two rows sharing at least `min_shared` leading slots, at most `group_max` rows each,
    the first position leading. Rows are grouped by their first slot, in batch order."""
    by_first: dict[int, list[int]] = {}
    for position, slots in enumerate(prefixes):
        if slots:
            by_first.setdefault(slots[0], []).append(position)
    groups = []
    for positions in by_first.values():
        for start in range(0, len(positions) - 1, group_max):
            members = positions[start : start + group_max]
            if len(members) < 2:
                continue
            leader = prefixes[members[0]]
            shared = min(len(prefixes[p]) for p in members)
            for position in members[1:]:
                shared = _common_length(leader, prefixes[position], shared)
            if shared >= min_shared:
                groups.append((shared, members))
    return groups


def _common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The common leading length (<= limit) of two tree paths that agree at position 0."""
    if a[limit - 1] == b[limit - 1]:
        return limit
    agree, differ = 1, limit  # a[:agree] == b[:agree]; they differ within [:differ]
    while differ - agree > 1:
        middle = (agree + differ) // 2
        if a[middle - 1] == b[middle - 1]:
            agree = middle
        else:
            differ = middle
    return agree
