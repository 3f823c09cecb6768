"""A count-annotated trie of every suffix of some token sequences, cut at a fixed depth (SuffixDecoding's
suffix tree, Oliaro et al. 2024): the node of a path counts how often that path occurs, so the most
frequent continuation of any recent context is a walk down its best children.

Sequences grow token by token at O(depth) each: the nodes of the current end's suffixes (the "open"
nodes, one per length) each gain the new token as a child. Each node remembers its most frequent child,
so a draft costs O(its length), however many children a node has.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("count", "children", "best")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.best: tuple[int, _Node] | None = None  # (token, child) with the highest count


class SuffixTrie:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError("a suffix trie needs depth >= 2 to match one token and draft one")
        self.max_depth = max_depth
        self.root = _Node()

    def open_nodes(self) -> list[_Node]:
        """The open nodes of an empty sequence, to pass to `append`."""
        return [self.root]

    def append(self, open_nodes: list[_Node], token: int) -> list[_Node]:
        """Add `token` after the sequence whose open nodes are given; returns the new open nodes
        (index d: the node of the sequence's last d tokens)."""
        grown = [self.root]
        for node in open_nodes:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            if node.best is None or child.count > node.best[1].count:
                node.best = (token, child)
            if len(grown) < self.max_depth:
                grown.append(child)
        return grown

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a sequence added earlier with `append`, token by token (counts drop; empty nodes go)."""
        open_nodes = [self.root]
        for token in tokens:
            grown = [self.root]
            for node in open_nodes:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                if node.best is not None and node.best[1] is child:
                    node.best = max(node.children.items(), key=lambda item: item[1].count, default=None)
                if len(grown) < self.max_depth:
                    grown.append(child)  # (a detached child is still walked, so its subtree drops too)
            open_nodes = grown

    def find(self, context: Sequence[int], max_length: int) -> tuple[_Node, int] | None:
        """The deepest node (at most `max_length`) matching a suffix of `context` that has a continuation,
        and its depth."""
        for length in range(min(len(context), self.max_depth - 1, max_length), 0, -1):
            node: _Node | None = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token) if node is not None else None
            if node is not None and node.best is not None:
                return node, length
        return None


def walk(node: _Node, max_tokens: int, min_probability: float) -> tuple[list[int], float]:
    """Follow the most frequent children from `node` while the path's estimated probability stays at
    least `min_probability`: the draft, and its expected number of accepted tokens (sum of the path's
    probabilities at each depth)."""
    draft: list[int] = []
    probability, expected = 1.0, 0.0
    while len(draft) < max_tokens and node.best is not None:
        token, child = node.best
        probability *= child.count / node.count
        if probability < min_probability:
            break
        draft.append(token)
        expected += probability
        node = child
    return draft, expected
