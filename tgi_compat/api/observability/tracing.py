"""OpenTelemetry spans for requests, shaped like TGI's router traces.

With `--otlp-endpoint` set, each request gets a root span named after its route handler, as TGI's
`#[instrument]` names them (`generate`, `generate_stream`, `compat_generate`, `chat_completions`,
`completions`, `vertex_compatibility`, `tokenize`), parented to the caller's W3C `traceparent`
when one is sent. Inside it sit the phases TGI records: `validate`, `queued`, `infer` (with our
engine's `prefill` and `decode` under it) and `send_error` when generation fails. The route span
carries TGI's fields: total_time, validation_time, queue_time, inference_time, time_per_token, seed.

Without an endpoint every helper is a cheap no-op, so routes call them unconditionally.
Two ways to use it:

  * `install_tracing(app, tracer)`: an ASGI middleware opens the route span for every generation
    route and makes it `current_span()` for the request's code (streamed bodies included), which
    then only adds what it knows:
        current_span().record_generation(timings, seed=...)      # on success
        current_span().record_error(error.message, error.error_type)  # on failure
  * by hand: `with tracer.request_span("generate", headers) as span: with span.child("validate"): ...`
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from tgi_compat.api.observability.durations import RequestDurations

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


@contextmanager
def _ending(tracer: trace.Tracer, span: Span) -> Iterator[RequestSpan]:
    """The span for the `with` block: an exception escaping it marks the span failed; it ends either way."""
    try:
        yield RequestSpan(tracer, span)
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        raise
    finally:
        span.end()


class RequestStamps(Protocol):
    """A request's `time.perf_counter()` stamps (serving.generation.Timings)."""

    arrival: float
    validated: float
    first_event: float | None
    finished: float | None


class RequestSpan:
    """One request's root span plus helpers to hang TGI's phase spans under it (tracing off:
    OpenTelemetry's no-op tracer and invalid span, which records nothing)."""

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self._tracer = tracer
        self.span = span

    @property
    def recording(self) -> bool:
        return self.span.is_recording()

    def _context(self, parent: Span | None = None):
        return trace.set_span_in_context(parent or self.span)

    @contextmanager
    def child(self, name: str, **attributes: object) -> Iterator[RequestSpan]:
        """A phase timed by the `with` block (`validate`, `infer`, ...); errors mark it failed."""
        if not self.recording:
            yield _NOOP_SPAN
            return
        span = self._tracer.start_span(name, context=self._context(), attributes=_clean(attributes))
        with _ending(self._tracer, span) as request_span:
            yield request_span

    def record_phase(self, name: str, start_ns: int, end_ns: int, **attributes: object) -> RequestSpan:
        """A phase measured elsewhere (`queued`, `prefill`, `decode`): explicit `time.time_ns()` bounds."""
        if not self.recording:
            return _NOOP_SPAN
        span = self._tracer.start_span(
            name, context=self._context(), start_time=start_ns, attributes=_clean(attributes)
        )
        span.end(end_time=max(start_ns, end_ns))
        return RequestSpan(self._tracer, span)

    def set(self, **attributes: object) -> None:
        if self.recording:
            self.span.set_attributes(_clean(attributes))

    def set_timings(self, durations: RequestDurations, seed: int | None = None) -> None:
        """TGI's route-span fields, recorded when a generation succeeds."""
        self.set(
            total_time=format_duration(durations.total_s),
            validation_time=format_duration(durations.validation_s),
            queue_time=format_duration(durations.queue_s),
            inference_time=format_duration(durations.inference_s),
            time_per_token=format_duration(durations.time_per_token_s),
            seed=None if seed is None else str(seed),
        )

    def record_generation(
        self, timings: RequestStamps, seed: int | None = None, generated_tokens: int | None = None
    ) -> None:
        """TGI's phases from a request's `time.perf_counter()` stamps (`timings.arrival`,
        `.validated`, `.first_event`, `.finished`; the last two may be None): `validate`
        (arrival -> validated), `queued` (validated -> first token, so it includes our prefill)
        and `infer` (first token -> end), plus the route span's timing fields."""
        if not self.recording:
            return
        now_perf, now_ns = time.perf_counter(), time.time_ns()

        def wall_ns(stamp: float) -> int:
            return now_ns - int((now_perf - stamp) * 1e9)

        arrival, validated = timings.arrival, timings.validated or timings.arrival
        first = timings.first_event or validated
        finished = timings.finished or now_perf
        self.record_phase("validate", wall_ns(arrival), wall_ns(validated))
        self.record_phase("queued", wall_ns(validated), wall_ns(first))
        self.record_phase("infer", wall_ns(first), wall_ns(finished))
        inference = max(finished - first, 0.0)
        per_token = inference / generated_tokens if generated_tokens else 0.0
        self.set_timings(
            RequestDurations(finished - arrival, validated - arrival, first - validated, inference, per_token), seed
        )

    def record_error(self, message: str, error_type: str | None = None) -> None:
        """A failed request: a `send_error` span (TGI's name) and an ERROR status on the route span."""
        if not self.recording:
            return
        now = time.time_ns()
        self.record_phase("send_error", now, now, error=message, error_type=error_type)
        self.span.set_status(Status(StatusCode.ERROR, message))


_NOOP_SPAN = RequestSpan(trace.NoOpTracer(), trace.INVALID_SPAN)
_CURRENT_SPAN: contextvars.ContextVar[RequestSpan] = contextvars.ContextVar("tgi_request_span", default=_NOOP_SPAN)


def current_span() -> RequestSpan:
    """The route span of the request being handled (a no-op span outside one, or when off)."""
    return _CURRENT_SPAN.get()


def _clean(attributes: Mapping[str, object]) -> dict[str, AttributeValue]:
    """OTel takes str/bool/int/float (or lists of them); anything else becomes its repr."""
    cleaned: dict[str, AttributeValue] = {}
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
    def request_span(
        self, name: str, headers: Mapping[str, str] | None = None, **attributes: object
    ) -> Iterator[RequestSpan]:
        """The root span of one request, child of the caller's `traceparent` if it sent one.
        An exception escaping the block marks the span failed and propagates."""
        if self._tracer is None:
            yield _NOOP_SPAN
            return
        parent = _PROPAGATOR.extract(carrier=dict(headers or {}))
        span = self._tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=_clean(attributes))
        with _ending(self._tracer, span) as request_span:
            yield request_span

    def start_request_span(
        self, name: str, headers: Mapping[str, str] | None = None, **attributes: object
    ) -> RequestSpan:
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


# Route span names: TGI's handler function names (tgi_compat/router/src/server.rs, `#[instrument]`).
ROUTE_SPANS = {
    ("POST", "/"): "compat_generate",
    ("POST", "/generate"): "generate",
    ("POST", "/generate_stream"): "generate_stream",
    ("POST", "/v1/chat/completions"): "chat_completions",
    ("POST", "/v1/completions"): "completions",
    ("POST", "/vertex"): "vertex_compatibility",
    ("POST", "/invocations"): "sagemaker_compatibility",
    ("POST", "/tokenize"): "tokenize",
    ("POST", "/chat_tokenize"): "get_chat_tokenize",
}


class TracingMiddleware:
    """Pure ASGI: one route span per generation request, open until the last body byte is sent."""

    def __init__(self, app, tracer: RequestTracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope, receive, send) -> None:
        name = ROUTE_SPANS.get((scope.get("method"), scope.get("path"))) if scope["type"] == "http" else None
        if name is None or not self.tracer.enabled:
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        span = self.tracer.start_request_span(name, headers)

        async def send_with_status(message) -> None:
            if message["type"] == "http.response.start":
                span.set(**{"http.status_code": message["status"]})
                if message["status"] >= 500:
                    span.span.set_status(Status(StatusCode.ERROR))
            await send(message)

        token = _CURRENT_SPAN.set(span)
        try:
            await self.app(scope, receive, send_with_status)
        except BaseException as exc:
            span.span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            _CURRENT_SPAN.reset(token)
            self.tracer.end_request_span(span)


def install_tracing(app, tracer: RequestTracer) -> None:
    """Add the route-span middleware to a FastAPI/Starlette app (a no-op tracer adds nothing)."""
    if tracer.enabled:
        app.add_middleware(TracingMiddleware, tracer=tracer)
