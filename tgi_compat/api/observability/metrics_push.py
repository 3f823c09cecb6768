"""LightLLM's `--metric_gateway`: push the server's metrics to a Prometheus Pushgateway.

    --metric_gateway host:port   --job_name lightllm   --grouping_key k=v (repeatable)
    --push_interval 10           --enable_monitor_auth (basic auth from env USERNAME / PASSWORD)

A daemon thread calls `prometheus_client.push_to_gateway` (PUT: replace the group) every interval.
The body is `ServerMetrics.render()`, the same text `/metrics` serves, so TGI's bare counter names
survive (prometheus_client's own encoder would add `_total`). A failed push is logged and retried
at the next tick; the server never stops because the gateway is down.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.exposition import basic_auth_handler, default_handler, push_to_gateway

from tgi_compat.api.observability.metrics import ServerMetrics

logger = logging.getLogger("tgi_compat.metrics_push")


@dataclass(frozen=True, slots=True)
class PushGatewayConfig:
    gateway: str  # host:port or a URL
    job_name: str = "lightllm"
    grouping_key: dict[str, str] = field(default_factory=dict)
    interval_s: float = 10.0
    username: str | None = None  # set only with --enable_monitor_auth
    password: str | None = None

    @classmethod
    def from_flags(
        cls,
        gateway: str,
        job_name: str = "lightllm",
        grouping_key: Sequence[str] = (),
        push_interval: float = 10.0,
        enable_monitor_auth: bool = False,
    ) -> PushGatewayConfig:
        """From LightLLM's flags; `grouping_key` items are `key=value`."""
        pairs = {}
        for item in grouping_key:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--grouping_key expects key=value, got {item!r}")
            pairs[key] = value
        username = password = None
        if enable_monitor_auth:
            username, password = os.environ.get("USERNAME"), os.environ.get("PASSWORD")
            if not username or password is None:
                raise ValueError("--enable_monitor_auth needs the USERNAME and PASSWORD environment variables")
        return cls(gateway, job_name, pairs, push_interval, username, password)


class MetricsPusher:
    def __init__(self, metrics: ServerMetrics, config: PushGatewayConfig) -> None:
        self._metrics = metrics
        self.config = config
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-push", daemon=True)
        self.pushes = 0  # successful pushes, for logs and tests
        self.failures = 0

    def _handler(self, url, method, timeout, headers, data):
        body = self._metrics.render()  # our exposition, not prometheus_client's re-encoding
        if self.config.username is not None:
            return basic_auth_handler(url, method, timeout, headers, body, self.config.username, self.config.password)
        return default_handler(url, method, timeout, headers, body)

    def push_once(self) -> bool:
        try:
            push_to_gateway(
                self.config.gateway,
                job=self.config.job_name,
                registry=self._metrics.registry,
                grouping_key=self.config.grouping_key or None,
                timeout=max(1.0, min(30.0, self.config.interval_s)),
                handler=self._handler,
            )
        except Exception as error:  # network errors, 4xx/5xx from the gateway
            self.failures += 1
            logger.warning("Pushing metrics to %s failed: %s", self.config.gateway, error)
            return False
        self.pushes += 1
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.push_once()

    def start(self) -> MetricsPusher:
        self._thread.start()
        return self

    def stop(self, final_push: bool = True) -> None:
        """Stop the thread; one last push so the gateway holds the final counts."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.interval_s + 5)
        if final_push:
            self.push_once()
