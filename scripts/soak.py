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


def tgi_as_served(document: dict) -> dict:
    """TGI's document plus the responses TGI's router gives and the document omits."""
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if method == "post":
                for status, description in AXUM_REJECTIONS.items():
                    response = responses.setdefault(status, {"description": description})
                    response.setdefault("content", {})["text/plain"] = {"schema": {"type": "string"}}
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
    command = [sys.executable, "-m", "tgi_compat.cli.launcher", "--hostname", "127.0.0.1", "--port", str(port), *flags]
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


def fuzz(url: str, minutes: float, workers: int, report_dir: str) -> int:
    spec = tgi_as_served(openapi_30(json.loads(SPEC.read_text())))
    spec_path = Path(report_dir) / "tgi-openapi-3.0.json"
    spec_path.write_text(json.dumps(spec))
    command = [
        str(Path(sys.executable).with_name("schemathesis")), "run", str(spec_path),
        "--url", url,
        "--workers", str(workers),
        "--max-time", str(int(minutes * 60)),
        "--checks", "all",
        "--request-timeout", "120",
        "--continue-on-failure",
        "--report", "junit",
        "--report-dir", report_dir,
    ]  # fmt: skip
    # /generate_stream validates inside the stream, as TGI does: a 200 whose one event is the error
    config = Path(report_dir) / "schemathesis.toml"
    config.write_text(
        '[[operations]]\ninclude-path = "/generate_stream"\nchecks.negative_data_rejection.enabled = false\n'
    )
    command[1:1] = ["--config-file", str(config)]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=report_dir).returncode  # its example cache stays out of the repo


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
        fuzz_rc = fuzz(url, args.minutes, args.workers, report_dir)
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
