"""start_ops_services: the push gateway and stats line follow the config fields."""

import logging
import time

from tgi_compat.api.config import ServerConfig
from tgi_compat.api.observability.durations import RequestDurations
from tgi_compat.api.observability.metrics import ServerMetrics
from tgi_compat.api.server.ops_services import start_ops_services


def test_nothing_starts_for_a_plain_tgi_config():
    services = start_ops_services(ServerMetrics(10, 20), ServerConfig(port=80))
    assert services.pusher is None and services.stats_logger is None
    services.stop()


def test_gateway_and_stats_line_from_lightllm_fields(collector, caplog):
    caplog.set_level(logging.INFO, logger="tgi_compat.stats")
    metrics = ServerMetrics(10, 20)
    config = ServerConfig(
        metric_gateway=collector.address,
        metric_job_name="tgi",
        metric_grouping_key=["host=h1"],
        metric_push_interval=0.05,
        enable_monitor_auth=False,
        disable_log_stats=False,
        log_stats_interval=0.05,
    )
    services = start_ops_services(metrics, config)
    metrics.request_succeeded(RequestDurations(0.1, 0, 0, 0.1, 0.05), input_len=4, generated_tokens=2, max_new_tokens=2)
    assert collector.wait_for(lambda r: len(r.pushes) >= 1, timeout=5)
    deadline = time.monotonic() + 5
    while not any("generation throughput" in r.message for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.02)
    services.stop()
    assert collector.recorded.pushes[-1][1] == "/metrics/job/tgi/host/h1"
    assert b"tgi_request_success 1" in collector.recorded.pushes[-1][3]
    assert any("generation throughput" in r.message for r in caplog.records)


def test_disable_log_stats():
    config = ServerConfig(disable_log_stats=True, log_stats_interval=10)
    assert start_ops_services(ServerMetrics(10, 20), config).stats_logger is None
