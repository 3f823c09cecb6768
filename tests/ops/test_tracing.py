"""Spans from the tracing helpers reach a real OTLP/HTTP receiver with TGI's names and parenting."""

import time

from tgi_compat.tracing import DEFAULT_SERVICE_NAME, RequestTracer, format_duration, otlp_traces_url

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
        span.set_timings(total_s=0.0095, validation_s=0.0005, queue_s=0.001, inference_s=0.008,
                         time_per_token_s=0.002, seed=42)
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
        span.set_timings(1, 1, 1, 1, 1)
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
