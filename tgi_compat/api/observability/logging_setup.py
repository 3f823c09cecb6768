"""Logging: TGI's plain or `--json-output` lines, request ids, and LightLLM's periodic stats line.

* `configure_logging(json_output)`: one stderr handler. Plain lines look like TGI's
  (`2026-01-01T00:00:00.123456Z  INFO tgi_compat.api.routes: message`); JSON lines carry the same
  keys as TGI's `tracing_subscriber` JSON with `flatten_event` (timestamp, level, message, target,
  filename, line_number) plus `request_id` and any `extra={...}` fields. `LOG_LEVEL` sets the level
  (`info`, `debug`, or TGI's `info,text_generation_router=debug` form: its first item).
* `request_context(request_id)`: every record logged inside carries that id.
* Prompts and generated text stay out of logs unless `LOG_PROMPTS=1` (or `log_prompts=True`):
  `loggable_text()` gives their length instead.
* `StatsLogger`: every `--log_stats_interval` seconds (LightLLM default 10; `--disable_log_stats`
  turns it off) one line with prompt and generation throughput, queue and KV use.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from tgi_compat.api.observability.metrics import MetricsSnapshot, ServerMetrics

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_log_prompts = False

# LogRecord attributes that are not user `extra` fields.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "request_id",
}


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


@contextmanager
def request_context(request_id: str | None = None) -> Iterator[str]:
    """Tag every log record emitted inside with `request_id` (a fresh one when None)."""
    rid = request_id or new_request_id()
    token = _request_id.set(rid)
    try:
        yield rid
    finally:
        _request_id.reset(token)


def loggable_text(text: str) -> str:
    """User text as it may appear in logs: verbatim only when prompt logging was asked for."""
    return text if _log_prompts else f"<{len(text)} chars>"


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        return True


def _timestamp(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class PlainFormatter(logging.Formatter):
    """`<timestamp> <LEVEL> <target>: [request_id] message`, TGI's text layout."""

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        prefix = f"[{rid}] " if rid else ""
        line = f"{_timestamp(record)} {record.levelname:>5} {record.name}: {prefix}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line, TGI's flattened-event keys plus our extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "timestamp": _timestamp(record),
            "level": record.levelname.replace("WARNING", "WARN"),
            "message": record.getMessage(),
            "target": record.name,
            "filename": record.pathname,
            "line_number": record.lineno,
        }
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def log_level_from_env(default: str = "INFO") -> str:
    raw = os.environ.get("LOG_LEVEL", default).split(",")[0].strip()
    level = raw.split("=")[-1].upper()  # "text_generation_router=debug" -> DEBUG
    level = {"WARN": "WARNING", "TRACE": "DEBUG"}.get(level, level)
    return level if level in logging.getLevelNamesMapping() else default


def configure_logging(json_output: bool = False, level: str | None = None, log_prompts: bool | None = None) -> None:
    """Install the root handler (idempotent: replaces handlers a previous call installed)."""
    global _log_prompts
    _log_prompts = (
        log_prompts if log_prompts is not None else os.environ.get("LOG_PROMPTS", "") not in ("", "0", "false")
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else PlainFormatter())
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level or log_level_from_env())
    # uvicorn's access log repeats what our request lines say; keep its errors only.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def format_stats_line(before: MetricsSnapshot, after: MetricsSnapshot, elapsed_s: float) -> str:
    elapsed_s = max(elapsed_s, 1e-9)
    prompt_tps = (after.prompt_tokens - before.prompt_tokens) / elapsed_s
    gen_tps = (after.generated_tokens - before.generated_tokens) / elapsed_s
    kv = "n/a" if after.kv_usage is None else f"{after.kv_usage * 100:.1f}%"
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hit_rate = (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0
    return (
        f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} tokens/s, "
        f"Running: {after.running} reqs, Waiting: {after.waiting} reqs, KV cache usage: {kv}, "
        f"Prefix cache hit rate: {hit_rate * 100:.1f}%, Cached tokens: {after.cached_tokens}"
    )


class StatsLogger:
    """LightLLM's `Stats`: a throughput line every interval while the server has done work."""

    def __init__(self, metrics: ServerMetrics, interval_s: float = 10.0, logger: logging.Logger | None = None) -> None:
        self._metrics = metrics
        self.interval_s = interval_s
        self._logger = logger or logging.getLogger("tgi_compat.stats")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-log", daemon=True)

    def _run(self) -> None:
        before, since = self._baseline
        while not self._stop.wait(self.interval_s):
            after, now = self._metrics.snapshot(), time.monotonic()
            busy = after != before or after.running or after.waiting
            if busy:  # an idle server stays quiet, as LightLLM's does
                self._logger.info(format_stats_line(before, after, now - since))
            before, since = after, now

    def start(self) -> StatsLogger:
        self._baseline = (self._metrics.snapshot(), time.monotonic())  # taken here: no race with callers
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)
