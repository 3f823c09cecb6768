"""Operations features of the real server: /metrics after traffic, OTLP spans, api key, CORS,
payload limit, and a SIGTERM drain, all over raw HTTP against a launcher started with those flags.

This module starts its own launcher (the session server runs without an api key and without a
collector) and ends it with SIGTERM in the last test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import CHAT_PROMPT, Server, _free_port, _launcher_command, launched

from tests.ops.prometheus_samples import parse_samples


def _load(name: str, path: Path):
    # The fakes live with the unit tests; loaded by path under a unique name.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


FakeCollector = _load(
    "ops_fakes_for_integration", Path(__file__).resolve().parent.parent / "tests" / "ops" / "ops_fakes.py"
).FakeCollector

API_KEY = "ops-secret"
ALLOWED_ORIGIN = "http://allowed.example"
PAYLOAD_LIMIT = 8192
SERVICE_NAME = "tgi-compat-ops-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector():
    with FakeCollector() as fake:
        yield fake


@pytest.fixture(scope="module")
def ops_server(collector):
    port = _free_port()
    command = _launcher_command(port) + [
        "--api-key", API_KEY,
        "--cors-allow-origin", ALLOWED_ORIGIN,
        "--payload-limit", str(PAYLOAD_LIMIT),
        "--otlp-endpoint", f"http://{collector.address}",
        "--otlp-service-name", SERVICE_NAME,
        "--graceful-termination-timeout", "120",
    ]  # fmt: skip
    # The last test SIGTERMs it on purpose; anything still running then is killed at once.
    with launched(command, {**os.environ}, "launcher-ops-", stop_timeout_s=0) as handle:
        yield handle


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    return parse_samples(httpx.get(f"{server.base_url}/metrics", timeout=30).text)


def generate(server: Server, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", json=body, headers=headers or AUTH, timeout=120)


def test_metrics_follow_real_traffic(ops_server):
    before = scrape(ops_server)
    generated = 0
    for max_new_tokens in (3, 5):
        response = generate(
            ops_server, {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
        )
        assert response.status_code == 200, response.text
        generated += response.json()["details"]["generated_tokens"]
    invalid = generate(ops_server, {"inputs": CHAT_PROMPT, "parameters": {"top_n_tokens": 50}})
    assert invalid.status_code == 422
    after = scrape(ops_server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tgi_request_count") == 3
    assert delta("tgi_request_success") == 2
    assert delta("tgi_request_failure", err="validation") == 1
    assert delta("tgi_request_duration_count") == 2
    assert delta("tgi_request_generated_tokens_sum") == generated
    assert delta("tgi_request_max_new_tokens_sum") >= 8  # 3 + 5 (and the failed one, if it got that far)
    model = {"model_name": next(dict(k[1])["model_name"] for k in after if k[0] == "vllm:generation_tokens_total")}
    assert delta("vllm:generation_tokens_total", **model) == generated
    assert delta("vllm:e2e_request_latency_seconds_count", **model) == 2
    assert after[("tgi_queue_size", ())] == 0 and after[("tgi_batch_current_size", ())] == 0  # all done
    assert not [name for name, _ in after if name.startswith("tgi_") and name.endswith("_total")]


def test_otlp_spans_from_a_real_request(ops_server, collector):
    headers = {**AUTH, "traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"}
    response = generate(ops_server, {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": 2}}, headers)
    assert response.status_code == 200
    assert collector.wait_for(
        lambda r: any(s.trace_id == TRACE_ID and s.name == "generate" for s in r.spans), timeout=20
    )
    spans = [s for s in collector.recorded.spans if s.trace_id == TRACE_ID]
    root = next(s for s in spans if s.name == "generate" and s.parent_span_id == PARENT_SPAN)
    assert root.service_name == SERVICE_NAME
    children = {s.name for s in spans if s.parent_span_id == root.span_id}
    assert {"validate", "queued", "infer"} <= children, children
    assert root.end_ns > root.start_ns


def test_api_key_guards_generation_routes_only(ops_server):
    url = ops_server.base_url
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}
    for path in ("/generate", "/generate_stream", "/", "/tokenize"):
        denied = httpx.post(url + path, json=body, timeout=30)
        assert (denied.status_code, denied.content) == (401, b""), path
    wrong = httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    upper = httpx.post(url + "/generate", json=body, headers={"Authorization": f"BEARER {API_KEY.upper()}"}, timeout=60)
    assert upper.status_code == 200  # TGI compares the whole header case-insensitively
    for path in ("/health", "/info", "/metrics", "/v1/models", "/"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path


def test_cors_follows_the_allowed_origin_list(ops_server):
    url = ops_server.base_url + "/generate"
    preflight = httpx.options(
        url, headers={"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"}, timeout=30
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert preflight.headers["access-control-allow-methods"] == "GET,POST"
    assert preflight.headers["access-control-allow-headers"] == "content-type"
    other = httpx.options(
        url, headers={"Origin": "http://other.example", "Access-Control-Request-Method": "POST"}, timeout=30
    )
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    info = httpx.get(ops_server.base_url + "/info", headers={"Origin": ALLOWED_ORIGIN}, timeout=30)
    assert info.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_payload_limit(ops_server):
    body = json.dumps({"inputs": "x" * PAYLOAD_LIMIT}).encode()
    response = httpx.post(
        ops_server.base_url + "/generate",
        content=body,
        headers={**AUTH, "content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413
    assert response.text == "Failed to buffer the request body: length limit exceeded"
    assert (
        generate(ops_server, {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}).status_code == 200
    )  # still serving


def test_sigterm_drains_the_running_stream_then_exits_zero(ops_server):
    """Last test of the module: it stops the server."""
    events: list[dict] = []
    first_event = threading.Event()

    def stream() -> None:
        body = {"inputs": "Count from 1 to 100: 1, 2, 3,", "parameters": {"max_new_tokens": 12, "details": True}}
        with httpx.stream("POST", ops_server.base_url + "/generate_stream", json=body, headers=AUTH, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    first_event.set()
        first_event.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_event.wait(120)
    ops_server.process.send_signal(signal.SIGTERM)
    events_at_signal = len(events)
    time.sleep(1.0)
    with pytest.raises(httpx.TransportError):  # no new requests once draining
        httpx.get(ops_server.base_url + "/health", timeout=5)
    client.join(180)
    assert ops_server.process.wait(timeout=180) == 0, Path(ops_server.log_path).read_text()[-3000:]
    assert len(events) > events_at_signal, (events_at_signal, events)  # tokens kept coming after SIGTERM
    assert events[-1]["generated_text"] is not None, events  # and the request ran to its end
    assert events[-1]["details"]["generated_tokens"] == len(events)
