"""OpenTelemetry spans for requests, shaped like TGI's router traces.

With `--otlp-endpoint` set, each request gets a root span named after its route handler, as TGI's
`#[instrument]` names them (`generate`, `generate_stream`, `compat_generate`, `chat_completions`,
`completions`, `vertex_compatibility`, `tokenize`), parented to the caller's W3C `traceparent`
when one is sent. Inside it sit the phases TGI records: `validate`, `queued`, `infer` (with our
engine's `prefill` and `decode` under it) and `send_error` when generation fails. The route span
carries TGI's fields: total_time, validation_time, queue_time, inference_time, time_per_token, seed.

Without an endpoint every helper is a cheap no-op, so routes call them unconditionally:

    with tracer.request_span("generate", request.headers, parameters=params) as span:
        with span.child("validate"):
            ...
        span.record_phase("queued", submitted_ns, first_token_ns)
        span.set_timings(total_s=..., validation_s=..., ...)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

DEFAULT_SERVICE_NAME = "text-generation-inference.router"
_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_traces_url(endpoint: str) -> str:
    """`http://collector:4318` -> `http://collector:4318/v1/traces`; a URL with a path is kept."""
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def format_duration(seconds: float) -> str:
    """A duration the way Rust's `Duration` Debug prints it (`1.5s`, `12.3ms`, `870µs`), which is
    how TGI writes its span fields."""
    nanos = max(0, int(round(seconds * 1e9)))
    for unit, scale in (("s", 10**9), ("ms", 10**6), ("µs", 10**3)):
        if nanos >= scale:
            whole, frac = divmod(nanos, scale)
            digits = str(frac).rjust(len(str(scale)) - 1, "0").rstrip("0")
            return f"{whole}.{digits}{unit}" if digits else f"{whole}{unit}"
    return f"{nanos}ns"


class RequestSpan:
    """One request's root span plus helpers to hang TGI's phase spans under it."""

    def __init__(self, tracer: trace.Tracer | None, span: Span | None) -> None:
        self._tracer = tracer
        self.span = span

    @property
    def recording(self) -> bool:
        return self.span is not None and self.span.is_recording()

    def _context(self, parent: Span | None = None):
        return trace.set_span_in_context(parent or self.span)

    @contextmanager
    def child(self, name: str, **attributes: object) -> Iterator[RequestSpan]:
        """A phase timed by the `with` block (`validate`, `infer`, ...); errors mark it failed."""
        if not self.recording:
            yield _NOOP_SPAN
            return
        span = self._tracer.start_span(name, context=self._context(), attributes=_clean(attributes))
        try:
            yield RequestSpan(self._tracer, span)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            span.end()

    def record_phase(self, name: str, start_ns: int, end_ns: int, **attributes: object) -> RequestSpan:
        """A phase measured elsewhere (`queued`, `prefill`, `decode`): explicit `time.time_ns()` bounds."""
        if not self.recording:
            return _NOOP_SPAN
        span = self._tracer.start_span(name, context=self._context(), start_time=start_ns, attributes=_clean(attributes))
        span.end(end_time=max(start_ns, end_ns))
        return RequestSpan(self._tracer, span)

    def set(self, **attributes: object) -> None:
        if self.recording:
            self.span.set_attributes(_clean(attributes))

    def set_timings(
        self,
        total_s: float,
        validation_s: float,
        queue_s: float,
        inference_s: float,
        time_per_token_s: float,
        seed: int | None = None,
    ) -> None:
        """TGI's route-span fields, recorded when a generation succeeds."""
        self.set(
            total_time=format_duration(total_s),
            validation_time=format_duration(validation_s),
            queue_time=format_duration(queue_s),
            inference_time=format_duration(inference_s),
            time_per_token=format_duration(time_per_token_s),
            seed=None if seed is None else str(seed),
        )

    def record_error(self, message: str, error_type: str | None = None) -> None:
        """A failed request: a `send_error` span (TGI's name) and an ERROR status on the route span."""
        if not self.recording:
            return
        now = time.time_ns()
        self.record_phase("send_error", now, now, error=message, error_type=error_type)
        self.span.set_status(Status(StatusCode.ERROR, message))


_NOOP_SPAN = RequestSpan(None, None)


def _clean(attributes: Mapping[str, object]) -> dict[str, object]:
    """OTel takes str/bool/int/float (or lists of them); anything else becomes its repr."""
    cleaned: dict[str, object] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        cleaned[key] = value if isinstance(value, (str, bool, int, float)) else repr(value)
    return cleaned


class RequestTracer:
    """The process's tracer. `enabled` is False (and everything a no-op) without an endpoint."""

    def __init__(
        self,
        otlp_endpoint: str | None = None,
        service_name: str = DEFAULT_SERVICE_NAME,
        exporter: SpanExporter | None = None,
    ) -> None:
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if exporter is None and otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_traces_url(otlp_endpoint), timeout=10)
        if exporter is not None:
            resource = Resource.create({"service.name": service_name})
            self._provider = TracerProvider(resource=resource)
            self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
            self._tracer = self._provider.get_tracer("text_generation_router")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextmanager
    def request_span(self, name: str, headers: Mapping[str, str] | None = None, **attributes: object) -> Iterator[RequestSpan]:
        """The root span of one request, child of the caller's `traceparent` if it sent one.
        An exception escaping the block marks the span failed and propagates."""
        if self._tracer is None:
            yield _NOOP_SPAN
            return
        parent = _PROPAGATOR.extract(carrier=dict(headers or {}))
        span = self._tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=_clean(attributes))
        try:
            yield RequestSpan(self._tracer, span)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            span.end()

    def start_request_span(self, name: str, headers: Mapping[str, str] | None = None, **attributes: object) -> RequestSpan:
        """For streaming routes whose span outlives the handler: end it with `end_request_span`."""
        if self._tracer is None:
            return _NOOP_SPAN
        parent = _PROPAGATOR.extract(carrier=dict(headers or {}))
        span = self._tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=_clean(attributes))
        return RequestSpan(self._tracer, span)

    @staticmethod
    def end_request_span(span: RequestSpan) -> None:
        if span.recording:
            span.span.end()

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000)) if self._provider else True

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
