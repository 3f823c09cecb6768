"""The push-gateway thread against a local fake Pushgateway over HTTP."""

import base64

import pytest

from tgi_compat.api.observability.metrics import ServerMetrics
from tgi_compat.api.observability.metrics_push import MetricsPusher, PushGatewayConfig


def test_periodic_push_sends_our_exposition(collector):
    metrics = ServerMetrics(100, 200, "smol")
    metrics.request_received()
    config = PushGatewayConfig.from_flags(
        collector.address, job_name="tgi", grouping_key=["instance=a", "zone=b"], push_interval=0.05
    )
    pusher = MetricsPusher(metrics, config).start()
    assert collector.wait_for(lambda r: len(r.pushes) >= 2, timeout=5)
    metrics.request_received()
    pusher.stop()
    method, path, headers, body = collector.recorded.pushes[-1]
    assert method == "PUT"
    assert path == "/metrics/job/tgi/instance/a/zone/b"
    assert "Authorization" not in headers
    text = body.decode()
    assert "tgi_request_count 2\n" in text  # bare TGI name and the final count
    assert "tgi_request_count_total" not in text
    assert pusher.pushes >= 3


def test_basic_auth_from_environment(collector, monkeypatch):
    monkeypatch.setenv("USERNAME", "alice")
    monkeypatch.setenv("PASSWORD", "s3cret")
    metrics = ServerMetrics(100, 200)
    metrics.request_failed("validation")
    config = PushGatewayConfig.from_flags(f"http://{collector.address}", enable_monitor_auth=True)
    assert config.job_name == "lightllm" and config.interval_s == 10
    assert MetricsPusher(metrics, config).push_once()
    method, path, headers, body = collector.recorded.pushes[-1]
    assert path == "/metrics/job/lightllm"
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert b'tgi_request_failure{err="validation"} 1' in body


def test_failed_push_is_counted_not_raised():
    metrics = ServerMetrics(100, 200)
    pusher = MetricsPusher(metrics, PushGatewayConfig("127.0.0.1:1", interval_s=1))
    assert not pusher.push_once()
    assert pusher.failures == 1


def test_bad_flags(monkeypatch):
    with pytest.raises(ValueError):
        PushGatewayConfig.from_flags("h:1", grouping_key=["novalue"])
    monkeypatch.delenv("USERNAME", raising=False)
    with pytest.raises(ValueError):
        PushGatewayConfig.from_flags("h:1", enable_monitor_auth=True)
