"""Synthetic acceptance, for benchmarks on random weights only (vLLM's synthetic rejection sampler, SGLang's
SIMULATE_ACC_LEN): random weights never match an n-gram draft, so the verifier instead accepts a number of
drafts drawn from a replayed accepted-length distribution (e.g. a histogram measured on a real model,
docs/benchmarks/2026-12-04-spec-acceptance.json).

The first n drafts are taken as if they had matched and the target's own token at position n follows them:
the K/V stays consistent, since the drafts were the step's inputs. The output is NOT the model's greedy text.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SyntheticAcceptance:
    """weights[n]: how often n drafts were accepted (a histogram over 0..len - 1; need not be normalized)."""

    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.weights or any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError("synthetic_acceptance needs non-negative weights of accepted lengths 0, 1, ...")

    @classmethod
    def parse(cls, value: object) -> SyntheticAcceptance:
        """A list of weights, or the path of a JSON file holding one."""
        if isinstance(value, str):
            value = json.loads(Path(value).read_text())
        if not isinstance(value, list):
            raise ValueError("synthetic_acceptance: a list of weights or the path of a JSON file with one")
        return cls(tuple(float(w) for w in value))

    def mean(self, max_accepted: int) -> float:
        """The expected accepted drafts of a step of `max_accepted` drafts (the mass past it lands on it)."""
        total = sum(self.weights)
        return sum(min(n, max_accepted) * w for n, w in enumerate(self.weights)) / total

    def draw(self, max_accepted: int, rng: random.Random) -> int:
        cumulative = list(itertools.accumulate(self.weights))
        n = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
        return min(n, len(self.weights) - 1, max_accepted)
