"""Spans from the tracing helpers reach a real OTLP/HTTP receiver with TGI's names and parenting."""

import time

from tgi_compat.api.observability.durations import RequestDurations
from tgi_compat.api.observability.tracing import DEFAULT_SERVICE_NAME, RequestTracer, format_duration, otlp_traces_url

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def test_request_spans_are_exported_with_traceparent_parenting(collector):
    tracer = RequestTracer(f"http://{collector.address}", service_name="tgi-test")
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "content-type": "application/json"}
    with tracer.request_span("generate", headers, parameters={"max_new_tokens": 4}) as span:
        with span.child("validate"):
            pass
        submitted = time.time_ns()
        span.record_phase("queued", submitted, submitted + 1_000_000)
        with span.child("infer") as infer:
            infer.record_phase("prefill", submitted + 1_000_000, submitted + 3_000_000)
            infer.record_phase("decode", submitted + 3_000_000, submitted + 9_000_000)
        span.set_timings(RequestDurations(0.0095, 0.0005, 0.001, 0.008, 0.002), seed=42)
    assert tracer.force_flush()
    assert collector.wait_for(lambda r: len(r.spans) >= 6)
    spans = {s.name: s for s in collector.recorded.spans}
    assert set(spans) == {"generate", "validate", "queued", "infer", "prefill", "decode"}
    root = spans["generate"]
    assert root.trace_id == TRACE_ID and root.parent_span_id == PARENT_ID
    assert root.service_name == "tgi-test"
    for child in ("validate", "queued", "infer"):
        assert spans[child].parent_span_id == root.span_id and spans[child].trace_id == TRACE_ID
    assert spans["prefill"].parent_span_id == spans["infer"].span_id
    assert spans["decode"].end_ns - spans["decode"].start_ns == 6_000_000
    assert root.attributes["total_time"] == "9.5ms"
    assert root.attributes["seed"] == "42"
    assert root.attributes["parameters"] == "{'max_new_tokens': 4}"
    tracer.shutdown()


def test_errors_make_a_send_error_span_and_error_status(collector):
    tracer = RequestTracer(collector.address)  # bare host:port works too
    with tracer.request_span("generate_stream", {}) as span:
        span.record_error("Request failed during generation: engine died", "generation")
    tracer.force_flush()
    assert collector.wait_for(lambda r: len(r.spans) >= 2)
    spans = {s.name: s for s in collector.recorded.spans}
    assert spans["send_error"].parent_span_id == spans["generate_stream"].span_id
    assert spans["send_error"].attributes["error_type"] == "generation"
    assert spans["generate_stream"].status_code == 2  # STATUS_CODE_ERROR
    assert spans["generate_stream"].service_name == DEFAULT_SERVICE_NAME
    assert spans["generate_stream"].parent_span_id == ""  # no traceparent: a new trace
    tracer.shutdown()


def test_without_endpoint_everything_is_a_noop():
    tracer = RequestTracer(None)
    assert not tracer.enabled
    with tracer.request_span("generate", {"traceparent": "junk"}) as span:
        with span.child("validate") as child:
            child.set(x=1)
        span.record_phase("queued", 0, 1)
        span.set_timings(RequestDurations(1, 1, 1, 1, 1))
        span.record_error("x")
    assert not span.recording
    assert tracer.force_flush()


def test_helpers():
    assert otlp_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp_traces_url("c:4318") == "http://c:4318/v1/traces"
    assert otlp_traces_url("https://c/custom/path") == "https://c/custom/path"
    assert format_duration(1.5) == "1.5s"
    assert format_duration(0.000870) == "870µs"
    assert format_duration(0.0123) == "12.3ms"
    assert format_duration(0) == "0ns"


async def test_middleware_opens_route_spans_for_plain_and_streamed_responses(collector):
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    from tgi_compat.api.observability.tracing import current_span, install_tracing
    from tgi_compat.api.serving.generation import Timings

    tracer = RequestTracer(collector.address, service_name="mw")
    app = FastAPI()

    def timings():
        now = time.perf_counter()
        return Timings(arrival=now - 0.5, validated=now - 0.4, first_event=now - 0.3, finished=now)

    @app.post("/generate")
    async def generate():
        current_span().record_generation(timings(), seed=7, generated_tokens=3)
        return JSONResponse({"ok": True})

    @app.post("/generate_stream")
    async def generate_stream():
        async def events():
            yield b"data:1\n\n"
            current_span().record_error("Request failed during generation: boom", "generation")
            yield b"data:2\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/info")
    async def info():
        assert not current_span().recording  # only generation routes get spans
        return JSONResponse({})

    install_tracing(app, tracer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        assert (await client.post("/generate", headers=headers)).status_code == 200
        assert (await client.post("/generate_stream")).text == "data:1\n\ndata:2\n\n"
        assert (await client.get("/info")).status_code == 200
    tracer.force_flush()
    assert collector.wait_for(lambda r: len(r.spans) >= 6)
    spans = {s.name: s for s in collector.recorded.spans}
    root = spans["generate"]
    assert root.parent_span_id == PARENT_ID and root.attributes["http.status_code"] == 200
    assert root.attributes["seed"] == "7" and root.attributes["time_per_token"] == "100ms"
    for phase in ("validate", "queued", "infer"):
        assert spans[phase].parent_span_id == root.span_id
    assert 0.29e9 < spans["infer"].end_ns - spans["infer"].start_ns < 0.31e9
    stream = spans["generate_stream"]
    assert spans["send_error"].parent_span_id == stream.span_id and stream.status_code == 2
    assert "info" not in spans
    tracer.shutdown()
