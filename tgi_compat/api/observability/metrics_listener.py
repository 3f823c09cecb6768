"""TGI's second, Prometheus-only HTTP listener (`--prometheus-port`, default 9000; docs/contract.md §1).

metrics-exporter-prometheus serves the same exposition text as `GET /metrics` on the main port,
for a GET on any path, from its own socket on the same IP. Here: a small threaded http.server.
If the port is taken the server keeps running without it (a warning), since `/metrics` on the
main port still works.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tgi_compat.api.observability.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("tgi_compat.metrics_listener")


class PrometheusListener:
    def __init__(self, metrics: ServerMetrics, host: str, port: int) -> None:
        render = metrics.render

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = render()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not worth a log line each
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus-listener", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> PrometheusListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_prometheus_listener(metrics: ServerMetrics | None, host: str, port: int) -> PrometheusListener | None:
    """The listener, started; None (with a warning) when the port cannot be bound."""
    if metrics is None:
        return None
    try:
        return PrometheusListener(metrics, host, port).start()
    except OSError as error:
        logger.warning("Prometheus listener not started on %s:%d: %s (GET /metrics still works)", host, port, error)
        return None
