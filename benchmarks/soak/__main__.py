"""Soak test (not in CI): fuzz the real server from TGI's OpenAPI document while polling /health,
then check it still serves with its KV pool empty; then a burst of 1,000 concurrent streams.

    python -m benchmarks.soak                          # 20 min of schemathesis + the burst
    python -m benchmarks.soak --minutes 5 --no-burst
    python -m benchmarks.soak --url http://127.0.0.1:8080 --minutes 20   # a server you started

The server gets the flags of issue 13: --max-concurrent-requests 64 --max-total-tokens 512
--max-input-tokens 256 (the burst runs on a second launch that admits 1,024 concurrent requests).
Passes when: schemathesis finds no failure, every /health poll (every 2 s) answered 200 within
1 s, a /generate answers afterwards, and the KV pool is empty again once idle. Exit code 0 then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.soak.openapi import SPEC, openapi_30, tgi_as_served
from benchmarks.soak.server import HealthPoller, idle_and_serving, launched, rss_mib, stream_burst

FUZZ_FLAGS = ["--max-concurrent-requests", "64", "--max-total-tokens", "512", "--max-input-tokens", "256"]
BURST_FLAGS = ["--max-concurrent-requests", "1024", "--max-total-tokens", "512", "--max-input-tokens", "256"]
REPO = Path(__file__).resolve().parents[2]


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
    schemathesis = str(Path(sys.executable).with_name("schemathesis"))
    command = [schemathesis, "--config-file", str(config), "run", str(spec_path), "--url", url]
    command += ["--workers", str(workers), "--max-time", str(int(minutes * 60))]
    command += ["--max-response-time", str(max_response_s), "--continue-on-failure"]
    command += ["--request-timeout", str(max(120, 2 * max_response_s))]  # a slower answer is reported, not cut
    command += ["--report", "junit", "--report-dir", report_dir]
    # tgi_hooks.py: TGI's behaviour the document cannot state
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "benchmarks.soak.tgi_hooks", "PYTHONPATH": str(REPO)}
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=report_dir, env=env).returncode  # its example cache stays out of the repo


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
