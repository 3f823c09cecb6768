"""Integration fixtures: ONE real `text-generation-launcher` process for the whole session
(embedded SmolLM2, engine subprocess, real port), driven by real clients and raw HTTP.

Like TGI's integration suite: the launcher is started with flags, readiness is "the port answers
/health with 200" (before that the port refuses connections), and whole greedy responses are
compared with stored syrupy snapshots with a relative tolerance on logprobs.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from harness import Server, _free_port, _launcher_command, launched
from syrupy.extensions.json import JSONSnapshotExtension

from tests.xdist_threads import share_the_cores_among_xdist_workers

share_the_cores_among_xdist_workers()


@pytest.fixture(scope="session")
def server():
    if os.environ.get("TGI_COMPAT_SERVER_URL"):
        # A server someone already started with `_launcher_command`'s flags (for quick iteration).
        yield Server(os.environ["TGI_COMPAT_SERVER_URL"], None, os.devnull)  # type: ignore[arg-type]
        return
    with launched(_launcher_command(_free_port()), {**os.environ, "LOG_LEVEL": "info"}, "launcher-") as handle:
        yield handle


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url


@pytest.fixture
async def http(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        yield client


# ----------------------------------------------------------------------------------- snapshots


def _close(expected, actual, rtol: float) -> bool:
    """Equal JSON, floats within `rtol` (TGI's response_snapshot uses rtol=0.2 on logprobs)."""
    if isinstance(expected, float) or isinstance(actual, float):
        if expected is None or actual is None:
            return expected is actual
        return math.isclose(expected, actual, rel_tol=rtol, abs_tol=1e-3)
    if isinstance(expected, dict) and isinstance(actual, dict):
        return expected.keys() == actual.keys() and all(_close(expected[k], actual[k], rtol) for k in expected)
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(_close(e, a, rtol) for e, a in zip(expected, actual))
    return expected == actual


class ToleranceSnapshotExtension(JSONSnapshotExtension):
    rtol = 0.2

    def matches(self, *, serialized_data, snapshot_data) -> bool:
        try:
            return _close(json.loads(snapshot_data), json.loads(serialized_data), self.rtol)
        except (TypeError, ValueError):
            return False


@pytest.fixture
def response_snapshot(snapshot):
    return snapshot.use_extension(ToleranceSnapshotExtension)
