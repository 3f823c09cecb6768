"""Soak test (not in CI): fuzz the real server from TGI's OpenAPI document while polling /health,
then check it still serves with its KV pool empty; then a burst of 1,000 concurrent streams.

    python scripts/soak.py                          # 20 min of schemathesis + the burst
    python scripts/soak.py --minutes 5 --no-burst
    python scripts/soak.py --url http://127.0.0.1:8080 --minutes 20   # a server you started

The server gets the flags of issue 13: --max-concurrent-requests 64 --max-total-tokens 512
--max-input-tokens 256 (the burst runs on a second launch that admits 1,024 concurrent requests).
Passes when: schemathesis finds no failure, every /health poll (every 2 s) answered 200 within
1 s, a /generate answers afterwards, and the KV pool is empty again once idle. Exit code 0 then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "scripts" / "soak_data" / "tgi-openapi.json"  # TGI 3.3's own document, as it ships
FUZZ_FLAGS = ["--max-concurrent-requests", "64", "--max-total-tokens", "512", "--max-input-tokens", "256"]
BURST_FLAGS = ["--max-concurrent-requests", "1024", "--max-total-tokens", "512", "--max-input-tokens", "256"]
HEALTH_EVERY_S = 2.0
HEALTH_DEADLINE_S = 1.0


def openapi_30(document: dict) -> dict:
    """OpenAPI 3.1's numeric `exclusiveMinimum`/`exclusiveMaximum` in 3.0's boolean form."""
    document = copy.deepcopy(document)

    def fix(node):
        if isinstance(node, dict):
            for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
                value = node.get(flag)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    node[bound], node[flag] = value, True
            for child in node.values():
                fix(child)
        elif isinstance(node, list):
            for child in node:
                fix(child)

    fix(document)
    return document


# What TGI's router answers that its own document leaves out (axum's body extractor, TGI's handlers):
# without these, schemathesis reports TGI's real behaviour as findings.
AXUM_REJECTIONS = {
    "400": "Failed to parse the request body as JSON",
    "413": "Payload larger than --payload-limit",
    "415": "Expected request with `Content-Type: application/json`",
    "422": "Well-formed JSON with wrong types or missing fields",
}
MODEL_LIST = {  # GET /v1/models: TGI answers OpenAI's list of the one served model
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object"}}},
}


ERROR_RESPONSE = {"$ref": "#/components/schemas/ErrorResponse"}
OPENAI_STREAM_ERROR = {  # TGI's `into_openai_event`: errors inside an OpenAI-route stream
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "http_status_code"],
            "properties": {"message": {"type": "string"}, "http_status_code": {"type": "integer"}},
        }
    },
}
HEALTH = {  # GET / is TGI's alias of /health (axum: `.route("/", get(health))`); the document omits it
    "summary": "Health check method",
    "responses": {
        "200": {"description": "Everything is working fine"},
        "503": {
            "description": "Text generation inference is down",
            "content": {"application/json": {"schema": ERROR_RESPONSE}},
        },
    },
}


def _stream_errors(path: str) -> list[dict]:
    """What an error event of `path`'s stream looks like: /invocations answers with either route's shape."""
    if path.startswith("/v1/"):
        return [OPENAI_STREAM_ERROR]
    return [ERROR_RESPONSE, OPENAI_STREAM_ERROR] if path == "/invocations" else [ERROR_RESPONSE]


def sse_events(payload: dict, errors: list[dict]) -> dict:
    """An SSE event whose `data` is JSON matching `payload` or one of TGI's in-stream `errors`. OpenAPI
    3.0 tools read the document's own text/event-stream `schema` as the event object itself
    (`{data, event, ...}`), which no TGI event matches; 3.2's `itemSchema` says what is meant."""
    content = {"anyOf": [payload, *errors]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": content}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _serde_values(node):
    """utoipa writes the Rust values of `default` and `example` as strings ("null", "20", "[{...}]"), and
    serde refuses a string where a number, boolean or object is expected (TGI answers `seed: "null"`
    with a 422 too): put back the values meant. "null" is null even for a string field (a Rust `None`)."""
    if isinstance(node, dict):
        for key in ("default", "example"):
            value = node.get(key)
            if value == "null":
                node[key] = None
            elif isinstance(value, str) and node.get("type") in ("integer", "number", "boolean", "array"):
                with contextlib.suppress(ValueError):  # an array example is JSON text (`messages`)
                    node[key] = json.loads(value)
        for child in node.values():
            _serde_values(child)
    elif isinstance(node, list):
        for child in node:
            _serde_values(child)


MAX_TOP_N_TOKENS = 5  # TGI's --max-top-n-tokens default (not in /info)


def _bounds(info: dict) -> dict[tuple[str, str], dict]:
    """TGI's validation (`Validation::validate` and the chat/completions mappings) as JSON Schema bounds, where
    the document has none or others; the server's limits come from its /info. A value out of these bounds
    is a 422 from TGI, so the document must not call it valid, nor call valid values invalid."""
    max_input, max_total = info["max_input_tokens"], info["max_total_tokens"]
    new_tokens = {"minimum": 1, "maximum": max_total - max_input}  # != 0; any prompt fits the budget
    open_unit = {"exclusiveMinimum": True, "minimum": 0, "exclusiveMaximum": True, "maximum": 1}  # 1.0 refused too
    penalty = {"minimum": -2, "maximum": 2, "exclusiveMinimum": False}  # -2.0 <= x <= 2.0
    u64 = {"format": None, "minimum": 0, "exclusiveMinimum": False, "maximum": 2**64 - 1}  # seeds: u64, not int64
    return {
        ("GenerateParameters", "max_new_tokens"): new_tokens,
        ("GenerateParameters", "top_p"): open_unit,
        ("GenerateParameters", "typical_p"): open_unit,
        ("GenerateParameters", "frequency_penalty"): penalty,
        ("GenerateParameters", "top_n_tokens"): {"minimum": 0, "exclusiveMinimum": False, "maximum": MAX_TOP_N_TOKENS},
        ("GenerateParameters", "truncate"): {"minimum": 1, "maximum": max_input},
        ("GenerateParameters", "seed"): u64,
        ("GenerateParameters", "best_of"): {"minimum": 0, "exclusiveMinimum": False, "maximum": info["max_best_of"]},
        ("GenerateParameters", "stop"): {"maxItems": info["max_stop_sequences"]},
        ("ChatRequest", "max_tokens"): new_tokens,
        ("ChatRequest", "top_logprobs"): {"maximum": MAX_TOP_N_TOKENS},  # becomes top_n_tokens
        ("ChatRequest", "temperature"): {"minimum": 0},  # 0 means greedy
        ("ChatRequest", "top_p"): open_unit,
        ("ChatRequest", "frequency_penalty"): penalty,
        ("ChatRequest", "presence_penalty"): {
            "minimum": -2,
            "exclusiveMinimum": True,
        },  # + 2.0 = repetition_penalty > 0
        ("ChatRequest", "stop"): {"maxItems": info["max_stop_sequences"]},
        ("ChatRequest", "seed"): u64,
        ("CompletionRequest", "max_tokens"): new_tokens,
        ("CompletionRequest", "temperature"): {"minimum": 0},
        ("CompletionRequest", "top_p"): open_unit,
        ("CompletionRequest", "frequency_penalty"): penalty,
        ("CompletionRequest", "repetition_penalty"): {"minimum": 0, "exclusiveMinimum": True},
        ("CompletionRequest", "stop"): {"maxItems": info["max_stop_sequences"]},
        ("CompletionRequest", "seed"): u64,
        ("CompletionRequest", "suffix"): {"enum": [None]},  # "Suffix is not supported": only null passes
    }


def tgi_as_served(document: dict, info: dict) -> dict:
    """TGI's document plus the responses TGI's router gives and the document omits, and the requests TGI
    (serde, then validation under the server's limits in `info`, its GET /info) accepts where the document
    says otherwise. Each change says why."""
    _serde_values(document)
    schemas = document["components"]["schemas"]
    for (name, field), bounds in _bounds(info).items():
        schema = schemas[name]["properties"][field]
        schema.update(bounds)
        if "format" in bounds and bounds["format"] is None:
            del schema["format"]
    # Validation refuses empty inputs and more than max_input_tokens of them; 60 characters are at most 240
    # UTF-8 bytes, so at most 240 tokens. /tokenize takes any (it does not validate).
    for name in ("GenerateRequest", "CompatGenerateRequest"):
        schemas[name]["properties"]["inputs"].update({"minLength": 1, "maxLength": 60})
    # best_of > 1 needs sampling and no seed (the rule names do_sample; temperature & co. would do too)
    schemas["GenerateParameters"]["anyOf"] = [
        {"properties": {"best_of": {"type": "integer", "maximum": 1, "nullable": True}}},
        {
            "required": ["do_sample"],
            "properties": {
                "do_sample": {"type": "boolean", "enum": [True]},
                "seed": {"enum": [None], "nullable": True},
            },
        },
    ]
    # A message needs `content` or `tool_calls` (serde: "did not match any variant of untagged enum
    # MessageBody"); schemathesis would build its example from the property examples, which have neither.
    schemas["Message"]["example"] = {"role": "user", "content": "What is Deep Learning?"}
    for part in schemas["Message"]["allOf"]:
        for field in part.get("properties", {}).values():
            field.pop("example", None)
    # SagemakerRequest is serde's untagged enum: the first variant that deserializes wins (a GenerateRequest
    # ignores unknown fields, so `{"inputs": ..., "messages": [...]}` is a generate request), not `oneOf`
    schemas["SagemakerRequest"]["anyOf"] = schemas["SagemakerRequest"].pop("oneOf")
    # /invocations answers an `inputs` request as POST / does: a one-element array
    one_generation = {"type": "array", "items": {"$ref": "#/components/schemas/GenerateResponse"}, "minItems": 1}
    schemas["SagemakerResponse"]["oneOf"][0] = one_generation
    # A named tool_choice (`{"type": "function", "function": {"name": N}}`: serde's tag is required too)
    # must name one of `tools`, else TGI answers a 422 tool error; a schema cannot tie the two fields,
    # so the soak sends only "auto", "none" and "required".
    schemas["ToolChoice"]["oneOf"] = [choice for choice in schemas["ToolChoice"]["oneOf"] if "enum" in choice]
    # response_format and tools together are a 422 tool error ("Grammar and tools are mutually exclusive",
    # even for `tools: []`); null is their absence
    schemas["ChatRequest"]["not"] = {
        "required": ["tools", "response_format"],
        "properties": {"tools": {"type": "array"}, "response_format": {"type": "object"}},
    }
    # `stream_options` is `#[serde(default)] StreamOptions`, not an Option: TGI refuses `null` with a 422.
    schemas["ChatRequest"]["properties"]["stream_options"].pop("nullable", None)
    # TGI's Prompt deserializer takes a string or a non-empty array ("Empty array detected ..." is a 422).
    # (and validation refuses an empty one, and more than --max-client-batch-size of them)
    prompt = {"type": "string", "minLength": 1, "maxLength": 60}
    many = {"type": "array", "items": prompt, "minItems": 1, "maxItems": info["max_client_batch_size"]}
    schemas["Prompt"] = {"anyOf": [prompt, many]}
    document["paths"]["/"]["get"] = HEALTH
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if method == "post":
                for status, description in AXUM_REJECTIONS.items():
                    response = responses.setdefault(status, {"description": description})
                    response.setdefault("content", {})["text/plain"] = {"schema": {"type": "string"}}
            if path in ("/tokenize", "/chat_tokenize"):
                # tokenizer, template and tool errors: TGI's JSON 422 (`Input validation error`, `template_error`)
                responses["422"]["content"]["application/json"] = {"schema": ERROR_RESPONSE}
            for response in responses.values():
                stream = response.get("content", {}).get("text/event-stream")
                if stream is not None and "schema" in stream:
                    stream["itemSchema"] = sse_events(stream.pop("schema"), _stream_errors(path))
            if path == "/v1/models":
                responses["200"]["content"]["application/json"]["schema"] = MODEL_LIST
    return document


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launched(flags: list[str], log_path: str) -> Iterator[tuple[str, subprocess.Popen]]:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "tgi_compat.api.cli.launcher",
        "--hostname",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"server exited with {process.returncode}; see {log_path}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()


class HealthPoller(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.polls = 0
        self.failures: list[tuple[float, str]] = []  # (seconds into the run, what went wrong)
        self.slowest = 0.0
        self._halt = threading.Event()
        self._began = time.monotonic()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._halt.wait(HEALTH_EVERY_S):
                began = time.monotonic()
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                took = time.monotonic() - began
                self.polls += 1
                self.slowest = max(self.slowest, took)
                if status != 200 or took > HEALTH_DEADLINE_S:
                    self.failures.append((round(began - self._began, 1), f"{status} in {took:.2f} s"))

    def stop(self) -> None:
        self._halt.set()
        self.join()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def idle_and_serving(url: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and metric(url, "tgi_batch_current_size") > 0:
        time.sleep(1)
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 8}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    time.sleep(1.5)  # the engine's idle stats report
    return {
        "generate_status": response.status_code,
        "batch_size": metric(url, "tgi_batch_current_size"),
        "queue_size": metric(url, "tgi_queue_size"),
        "kv_cache_usage": metric(url, "vllm:kv_cache_usage_perc"),
    }


HOOKS_DIR = REPO / "scripts" / "soak_data"  # tgi_hooks.py: TGI's behaviour the document cannot state


def schemathesis_config() -> str:
    """Every check; the built-in negative_data_rejection and positive_data_acceptance give way to the hooks'
    *_tgi versions (checks named on the command line, `--checks all`, would override settings made here)."""
    return (
        "[checks]\nenabled = true\n\n[checks.negative_data_rejection]\nenabled = false\n\n"
        "[checks.positive_data_acceptance]\nenabled = false\n"
    )


RESPONSE_TIME_FACTOR = 4.0


def calibrated_response_time(url: str, max_total_tokens: int) -> float:
    """The response-time limit for this machine: the longest answer the server allows (max_total_tokens
    tokens, the default length of `parameters: {}`) at the decode pace measured here alone, times 4 for
    what the fuzzing adds (two workers, /v1/completions' prompts x best_of sequences in one batch, a shared
    CPU). Schemathesis' own 10 s suits a GPU; on a 2-core CPU a default-length answer alone takes ~40 s."""
    body = {"inputs": "My name is Olivier and I", "parameters": {"max_new_tokens": 32, "stop": []}}
    paces = []
    for _ in range(2):  # the faster of two: the first may pay for a cold cache
        response = httpx.post(f"{url}/generate", json=body, timeout=600)
        response.raise_for_status()
        paces.append(int(response.headers["x-time-per-token"]) / 1000)
    return round(RESPONSE_TIME_FACTOR * max_total_tokens * max(min(paces), 0.001), 1)


def fuzz(url: str, minutes: float, workers: int, report_dir: str, max_response_s: float | None) -> int:
    info = httpx.get(f"{url}/info", timeout=30).json()
    if max_response_s is None:
        max_response_s = calibrated_response_time(url, info["max_total_tokens"])
    print(f"[soak] response-time limit {max_response_s:g} s", flush=True)
    spec = tgi_as_served(openapi_30(json.loads(SPEC.read_text())), info)
    spec_path = Path(report_dir) / "tgi-openapi-3.0.json"
    spec_path.write_text(json.dumps(spec))
    config = Path(report_dir) / "schemathesis.toml"
    config.write_text(schemathesis_config())
    command = [
        str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config), "run", str(spec_path),
        "--url", url,
        "--workers", str(workers),
        "--max-time", str(int(minutes * 60)),
        "--max-response-time", str(max_response_s),
        "--request-timeout", str(max(120, 2 * max_response_s)),  # a slower answer is reported, not cut
        "--continue-on-failure",
        "--report", "junit",
        "--report-dir", report_dir,
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tgi_hooks", "PYTHONPATH": str(HOOKS_DIR)}
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=report_dir, env=env).returncode  # its example cache stays out of the repo


async def stream_burst(url: str, count: int, max_new_tokens: int = 32) -> list[int]:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": max_new_tokens}}
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:

        async def one() -> int:
            tokens = 0
            async with client.stream("POST", "/generate_stream", json=body) as response:
                async for line in response.aiter_lines():
                    tokens += line.startswith("data:") and '"error"' not in line
            return tokens

        return await asyncio.gather(*(one() for _ in range(count)))


def rss_mib(pid: int) -> float:
    import psutil

    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children()]) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--max-response-time",
        type=float,
        help="seconds a response may take (schemathesis' max_response_time check); default: calibrated, "
        "4x the longest answer the server allows at the decode pace measured at the start",
    )
    parser.add_argument("--url", help="a running server (started with the flags above); default: launch one")
    parser.add_argument("--burst", type=int, default=1000, help="concurrent 32-token streams (0: none)")
    parser.add_argument("--no-burst", dest="burst", action="store_const", const=0)
    args = parser.parse_args()
    report_dir = tempfile.mkdtemp(prefix="soak-")
    ok = True
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(launched(FUZZ_FLAGS, f"{report_dir}/server.log"))[0]
        poller = HealthPoller(url)
        poller.start()
        fuzz_rc = fuzz(url, args.minutes, args.workers, report_dir, args.max_response_time)
        poller.stop()
        after = idle_and_serving(url)
        print(f"\n[soak] started {started}, {args.minutes:g} min of schemathesis: exit code {fuzz_rc}")
        print(f"[soak] /health: {poller.polls} polls, slowest {poller.slowest:.2f} s, failures {poller.failures[:20]}")
        print(f"[soak] afterwards: {after}")
        ok &= fuzz_rc == 0 and not poller.failures and after["generate_status"] == 200
        ok &= after["batch_size"] == 0 and after["kv_cache_usage"] == 0
    if args.burst:
        with launched(BURST_FLAGS, f"{report_dir}/burst-server.log") as (url, process):
            before = rss_mib(process.pid)
            poller = HealthPoller(url)
            poller.start()
            began = time.monotonic()
            counts = asyncio.run(stream_burst(url, args.burst))
            took = time.monotonic() - began
            poller.stop()
            after = idle_and_serving(url)
            rss = rss_mib(process.pid)
        complete = sum(count == 32 for count in counts)
        print(
            f"[soak] burst: {complete}/{args.burst} streams complete in {took:.0f} s; RSS {before:.0f} -> {rss:.0f} MiB"
        )
        print(
            f"[soak] burst /health: {poller.polls} polls, slowest {poller.slowest:.2f} s, failures {poller.failures[:20]}"
        )
        print(f"[soak] burst afterwards: {after}")
        ok &= complete == args.burst and not poller.failures and after["kv_cache_usage"] == 0
    print(f"[soak] {'PASS' if ok else 'FAIL'}; reports and server logs in {report_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
