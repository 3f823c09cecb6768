"""Tiny local HTTP receivers: an OTLP/HTTP trace collector and a Prometheus push gateway.

Both are real HTTP servers on 127.0.0.1 (ephemeral ports) run in a thread, so the code under test
goes through its real exporter / pusher over a socket.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.background import Background


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    status_code: int
    service_name: str


@dataclass
class Recorded:
    spans: list[ReceivedSpan] = field(default_factory=list)
    pushes: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)  # method, path, headers, body
    condition: threading.Condition = field(default_factory=threading.Condition)


def _any_value(value) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _decode_spans(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _any_value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: _any_value(a.value) for a in span.attributes},
                        status_code=span.status.code,
                        service_name=str(resource.get("service.name")),
                    )
                )
    return spans


class _Handler(BaseHTTPRequestHandler):
    recorded: Recorded

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _body(self) -> bytes:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return body

    def do_POST(self) -> None:
        body = self._body()
        if self.path == "/v1/traces":
            spans = _decode_spans(body)
            with self.recorded.condition:
                self.recorded.spans.extend(spans)
                self.recorded.condition.notify_all()
            payload = ExportTraceServiceResponse().SerializeToString()
            self._reply(200, payload, "application/x-protobuf")
        else:
            self._record_push("POST", body)

    def do_PUT(self) -> None:
        self._record_push("PUT", self._body())

    def do_DELETE(self) -> None:
        self._record_push("DELETE", b"")

    def _record_push(self, method: str, body: bytes) -> None:
        with self.recorded.condition:
            self.recorded.pushes.append((method, self.path, dict(self.headers), body))
            self.recorded.condition.notify_all()
        self._reply(200, b"", "text/plain")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class FakeCollector(Background):
    """Serves POST /v1/traces (OTLP/HTTP protobuf) and any PUT/POST/DELETE as a push gateway."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded = Recorded()
        handler = type("Handler", (_Handler,), {"recorded": self.recorded})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def _run(self) -> None:
        try:
            self._server.serve_forever()
        finally:
            self._server.server_close()

    def _halt(self) -> None:
        self._server.shutdown()

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        with self.recorded.condition:
            return self.recorded.condition.wait_for(lambda: predicate(self.recorded), timeout)
