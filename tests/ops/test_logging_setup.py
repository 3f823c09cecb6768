"""Log formats, request ids, prompt hiding and the periodic stats line."""

import json
import logging
import time

import pytest

from tgi_compat.api.observability import logging_setup
from tgi_compat.api.observability.durations import RequestDurations
from tgi_compat.api.observability.logging_setup import (
    JsonFormatter,
    PlainFormatter,
    StatsLogger,
    configure_logging,
    format_stats_line,
    log_level_from_env,
    loggable_text,
    request_context,
)
from tgi_compat.api.observability.metrics import MetricsSnapshot, ServerMetrics


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging_setup._log_prompts = False


def test_json_lines_carry_request_id_and_extras(capsys):
    configure_logging(json_output=True, level="INFO")
    log = logging.getLogger("tgi_compat.api.routes")
    with request_context("req-123"):
        log.info("Success", extra={"total_time": "1.2s", "generated_tokens": 7})
    log.info("outside")
    lines = [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]
    assert lines[0]["message"] == "Success" and lines[0]["level"] == "INFO"
    assert lines[0]["request_id"] == "req-123"
    assert lines[0]["target"] == "tgi_compat.api.routes"
    assert lines[0]["total_time"] == "1.2s" and lines[0]["generated_tokens"] == 7
    assert lines[0]["timestamp"].endswith("Z") and "line_number" in lines[0]
    assert "request_id" not in lines[1]


def test_plain_lines(capsys):
    configure_logging(json_output=False, level="INFO")
    with request_context("abc"):
        logging.getLogger("x").warning("careful")
    logging.getLogger("x").debug("hidden at info")
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert " WARNING x: [abc] careful" in err


def test_prompts_hidden_unless_asked(monkeypatch):
    monkeypatch.delenv("LOG_PROMPTS", raising=False)
    configure_logging()
    assert loggable_text("secret prompt") == "<13 chars>"
    configure_logging(log_prompts=True)
    assert loggable_text("secret prompt") == "secret prompt"


@pytest.mark.parametrize(
    "value,level",
    [("debug", "DEBUG"), ("info,text_generation_router=debug", "INFO"), ("warn", "WARNING"), ("junk", "INFO")],
)
def test_log_level_env(monkeypatch, value, level):
    monkeypatch.setenv("LOG_LEVEL", value)
    assert log_level_from_env() == level


def test_formatters_are_usable_standalone():
    record = logging.LogRecord("t", logging.ERROR, __file__, 1, "boom %s", ("x",), None)
    assert json.loads(JsonFormatter().format(record))["level"] == "ERROR"
    assert PlainFormatter().format(record).endswith("ERROR t: boom x")


def test_stats_logger_reports_throughput(caplog):
    metrics = ServerMetrics(100, 200)
    stats = StatsLogger(metrics, interval_s=0.05).start()
    caplog.set_level(logging.INFO, logger="tgi_compat.stats")
    metrics.request_succeeded(
        RequestDurations(1.0, 0.0, 0.0, 1.0, 0.1), input_len=50, generated_tokens=10, max_new_tokens=10
    )
    metrics.set_engine_stats(queue_size=1, batch_size=2, batch_max_tokens=10, kv_used=30, kv_total=100)
    deadline = time.monotonic() + 5
    while not any("Avg prompt throughput" in r.message for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.02)
    stats.stop()
    line = next(r.message for r in caplog.records if "Avg prompt throughput" in r.message)
    assert "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 30.0%" in line
    assert "Avg prompt throughput: 0.0" not in line  # 50 prompt tokens in a 50 ms window


def test_stats_line_reports_the_prefix_cache():
    before = MetricsSnapshot(0, 0, 0, 0, 0.5, prefix_cache_queries=100, prefix_cache_hits=10)
    after = MetricsSnapshot(0, 0, 0, 0, 0.5, prefix_cache_queries=300, prefix_cache_hits=160, cached_tokens=4321)
    assert "Prefix cache hit rate: 75.0%, Cached tokens: 4321" in format_stats_line(before, after, 1.0)
