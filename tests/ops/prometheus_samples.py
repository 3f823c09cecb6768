"""Prometheus text exposition read back into samples, for the unit and the integration tests of /metrics."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"([^{\s]+)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_samples(text: str) -> dict[tuple[str, tuple], float]:
    """(series name, sorted (label, value) pairs) -> value of every sample line; comment lines skipped."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            match = _SAMPLE.fullmatch(line)
            assert match, line
            labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
            values[(match.group(1), labels)] = float(match.group(3))
    return values
