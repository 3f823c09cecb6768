"""Prometheus primitives that render exactly like TGI's `metrics-exporter-prometheus` 0.15.

prometheus_client cannot produce TGI's exposition: its Counter always gains a `_total` suffix and
its numbers print Python-style (`10.0`, `1e-05`) where the Rust exporter prints `10` and `0.00001`.
So the `tgi_*` series live in these small thread-safe families, exposed to a prometheus_client
registry through a Collector (so push_to_gateway sees them), and `render_text` writes the text
format itself: counters keep the name they were given (bare for TGI, `_total` for vLLM's).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Generic, TypeVar

from prometheus_client.metrics_core import Metric

LabelKey = tuple[tuple[str, str], ...]
SUMMARY_QUANTILES = (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
ChildT = TypeVar("ChildT")  # the per-label-set state of one family kind


def format_value(value: float) -> str:
    """A float the way Rust's `Display` prints it: `10`, `0.00015000000000000001`, never `1e-05`."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e17:
        return str(int(value))
    return format(Decimal(repr(value)), "f")


def geometric_buckets(start: float, factor: float, count: int) -> list[float]:
    """`count` bounds start·factor^k, k=1..count, computed by repeated multiplication as TGI does
    (so the float bits, hence the printed `le` labels, match)."""
    bounds, value = [], start
    for _ in range(count):
        value *= factor
        bounds.append(value)
    return bounds


def linear_buckets(maximum: int, count: int = 100) -> list[float]:
    """(maximum/count)·k for k=1..count, TGI's length buckets."""
    step = float(maximum) / float(count)
    return [step * float(k + 1) for k in range(count)]


class _Family(Generic[ChildT]):
    """One named metric with per-label-set children; absent from the output until first use."""

    kind = ""

    def __init__(self, name: str, documentation: str = "", labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[LabelKey, ChildT] = {}

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple((name, str(labels[name])) for name in self.labelnames)

    def to_metric(self) -> Metric | None:
        with self._lock:
            children = list(self._children.items())
        if not children:
            return None
        metric = Metric(self.name, self.documentation, self.kind)
        for key, child in children:
            self._add_samples(metric, dict(key), child)
        return metric

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: ChildT) -> None:
        raise NotImplementedError


class _Scalar:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class BareCounter(_Family[_Scalar]):
    """A counter rendered under its own name, with no `_total` suffix."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        with self._lock:
            self._children.setdefault(self._key(labels), _Scalar()).value += amount

    def value(self, **labels: str) -> float:
        child = self._children.get(self._key(labels))
        return child.value if child is not None else 0.0

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: _Scalar) -> None:
        metric.add_sample(self.name, labels, child.value)


class SetGauge(_Family[_Scalar]):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._children.setdefault(self._key(labels), _Scalar()).value = float(value)

    def value(self, **labels: str) -> float | None:
        child = self._children.get(self._key(labels))
        return child.value if child is not None else None

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: _Scalar) -> None:
        metric.add_sample(self.name, labels, child.value)


class _HistogramState:
    __slots__ = ("counts", "total", "count")

    def __init__(self, num_buckets: int) -> None:
        self.counts = [0] * num_buckets  # non-cumulative, one per finite bound
        self.total = 0.0
        self.count = 0


class BucketHistogram(_Family[_HistogramState]):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, bounds: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = list(bounds)

    def observe(self, value: float, **labels: str) -> None:
        with self._lock:
            state = self._children.setdefault(self._key(labels), _HistogramState(len(self.bounds)))
            index = bisect.bisect_left(self.bounds, value)  # first bound >= value (le is inclusive)
            if index < len(self.bounds):
                state.counts[index] += 1
            state.total += value
            state.count += 1

    def _add_samples(self, metric: Metric, labels: dict[str, str], state: _HistogramState) -> None:
        running = 0
        for bound, count in zip(self.bounds, state.counts):
            running += count
            metric.add_sample(self.name + "_bucket", {**labels, "le": format_value(bound)}, running)
        metric.add_sample(self.name + "_bucket", {**labels, "le": "+Inf"}, state.count)
        metric.add_sample(self.name + "_sum", labels, state.total)
        metric.add_sample(self.name + "_count", labels, state.count)


class _SummaryState:
    __slots__ = ("window", "total", "count")

    def __init__(self, window: int) -> None:
        self.window: deque[float] = deque(maxlen=window)
        self.total = 0.0
        self.count = 0


class WindowSummary(_Family[_SummaryState]):
    """TGI renders un-bucketed histograms as summaries; quantiles come from the recent window."""

    kind = "summary"

    def __init__(self, name: str, documentation: str = "", labelnames: Sequence[str] = (), window: int = 4096) -> None:
        super().__init__(name, documentation, labelnames)
        self._window = window

    def observe(self, value: float, **labels: str) -> None:
        with self._lock:
            state = self._children.setdefault(self._key(labels), _SummaryState(self._window))
            state.window.append(value)
            state.total += value
            state.count += 1

    def _add_samples(self, metric: Metric, labels: dict[str, str], state: _SummaryState) -> None:
        ordered = sorted(state.window)
        for q in SUMMARY_QUANTILES:
            value = ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0
            metric.add_sample(self.name, {**labels, "quantile": format_value(q)}, value)
        metric.add_sample(self.name + "_sum", labels, state.total)
        metric.add_sample(self.name + "_count", labels, state.count)


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _sample_line(name: str, labels: dict[str, str], value: float) -> str:
    if labels:
        body = ",".join(f'{key}="{_escape_label(str(val))}"' for key, val in labels.items())
        return f"{name}{{{body}}} {format_value(float(value))}\n"
    return f"{name} {format_value(float(value))}\n"


def render_text(metrics: Iterable[Metric]) -> bytes:
    """Prometheus text format 0.0.4. A counter is typed under the name its samples carry, so bare
    TGI counters stay bare while prometheus_client's `_total` counters keep their suffix."""
    out: list[str] = []
    for metric in metrics:
        if not metric.samples:
            continue
        type_name = metric.name
        kind = {"unknown": "untyped", "info": "gauge", "stateset": "gauge"}.get(metric.type, metric.type)
        if metric.type == "counter" and all(s.name != metric.name for s in metric.samples):
            type_name = metric.name + "_total"
        created = [s for s in metric.samples if s.name.endswith("_created")]
        if metric.documentation:
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {type_name} {doc}\n")
        out.append(f"# TYPE {type_name} {kind}\n")
        for sample in metric.samples:
            if sample not in created:
                out.append(_sample_line(sample.name, sample.labels, sample.value))
        if created:  # prometheus_client's creation timestamps: a gauge of their own, as it renders them
            out.append(f"# TYPE {metric.name}_created gauge\n")
            out.extend(_sample_line(s.name, s.labels, s.value) for s in created)
    return "".join(out).encode("utf-8")
