"""The --prometheus-port listener serves the same exposition as /metrics, on any GET path."""

import logging
import socket

import httpx

from tgi_compat.api.observability.metrics import ServerMetrics
from tgi_compat.api.observability.metrics_listener import start_prometheus_listener


def test_serves_the_exposition_on_any_path():
    metrics = ServerMetrics(10, 20)
    metrics.request_received()
    listener = start_prometheus_listener(metrics, "127.0.0.1", 0)
    try:
        for path in ("/metrics", "/"):
            response = httpx.get(f"http://127.0.0.1:{listener.port}{path}", timeout=5)
            assert response.status_code == 200
            assert response.content == metrics.render()
            assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "tgi_request_count 1" in response.text
    finally:
        listener.stop()


def test_port_in_use_is_a_warning_not_a_failure(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with caplog.at_level(logging.WARNING):
            assert start_prometheus_listener(ServerMetrics(10, 20), "127.0.0.1", taken.getsockname()[1]) is None
    assert "Prometheus listener not started" in caplog.text
