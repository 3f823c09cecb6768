"""The Grafana dashboard only queries series the server really exports, with valid panel layout."""

import json
import os
import re

from tests.ops.prometheus_samples import parse_samples
from tgi_compat.api.observability.durations import RequestDurations
from tgi_compat.api.observability.metrics import ServerMetrics
from tgi_compat.router.stats import EngineStats, StepStats

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "grafana", "tgi-compat-dashboard.json")


def exported_series() -> set[str]:
    metrics = ServerMetrics(100, 200, "m")
    metrics.request_received()
    metrics.request_failed("overloaded")
    metrics.record_input_length(5, 10)
    metrics.request_succeeded(RequestDurations(1, 0.1, 0.1, 0.8, 0.1), 5, 10, 10, time_to_first_token_s=0.2)
    metrics.apply_engine_stats(
        EngineStats(
            1,
            1,
            10,
            5,
            100,
            1,
            steps=[
                StepStats("decode", 1, 0.1, 0.01, 0.12, ok=False),
                StepStats("prefill", 1, 0.1, 0.01, 0.12, new_batch_size=1),
            ],
        )
    )
    return {name for name, _ in parse_samples(metrics.render().decode())}


def test_every_query_uses_exported_series():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exported = exported_series()
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\b((?:tgi_|vllm:)[a-z_:]+)\b", target["expr"]))
            assert target["expr"].count("(") == target["expr"].count(")")
    assert queried and queried <= exported, queried - exported
    assert "tgi_request_count" in queried and "vllm:gpu_cache_usage_perc" in queried


def test_panels_do_not_overlap():
    with open(DASHBOARD) as f:
        panels = json.load(f)["panels"]
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
    assert len({p["id"] for p in panels}) == len(panels)
