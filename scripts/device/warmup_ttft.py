"""Start-up warm-up on the GPU: TTFT p99 of 64 simultaneous 256-token prompts right after /health
turns 200 must be within 2x of the same load a minute later (issue 13).

    python scripts/device/warmup_ttft.py            # builds /tmp/model (random Llama-3-8B) if missing

Prints one JSON line (cold and warm TTFT percentiles, their ratio, the server's warm-up log line)
and writes it to $OUT/warmup_ttft.json; exit code 0 when cold p99 <= 2 x warm p99.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("MODEL_DIR", "/tmp/model"))
OUT = Path(os.environ.get("OUT", REPO / "warmup-ttft-out"))
PORT = int(os.environ.get("PORT", "3000"))
CONCURRENCY, PROMPT_TOKENS, NEW_TOKENS = 64, 256, 16
URL = f"http://127.0.0.1:{PORT}"


def build_model() -> None:
    if (MODEL / "config.json").exists() and list(MODEL.glob("*.safetensors")):
        return
    command = [
        sys.executable,
        "-m",
        "benchmarks.random_model",
        str(MODEL),
        "--preset",
        "llama3-8b",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
    ]
    subprocess.run(command, cwd=REPO, check=True)


def start_server(log_path: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "tgi_compat.api.cli.launcher", "--model-id", str(MODEL),
        "--hostname", "127.0.0.1", "--port", str(PORT), "--max-concurrent-requests", "512",
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("server not ready in 480 s")


async def burst() -> list[float]:
    """TTFT (s) of CONCURRENCY simultaneous streams; `truncate` makes each prompt PROMPT_TOKENS long."""
    words = " ".join(f"word{i}" for i in range(4 * PROMPT_TOKENS))
    limits = httpx.Limits(max_connections=CONCURRENCY + 4)
    async with httpx.AsyncClient(base_url=URL, timeout=300, limits=limits) as client:

        async def one(i: int) -> float:
            body = {
                "inputs": f"{i} {words}",
                "parameters": {"max_new_tokens": NEW_TOKENS, "truncate": PROMPT_TOKENS},
            }
            started = time.perf_counter()
            first = None
            async with client.stream("POST", "/generate_stream", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and first is None:
                        assert '"error"' not in line, line
                        first = time.perf_counter() - started
            return first

        return await asyncio.gather(*(one(i) for i in range(CONCURRENCY)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    build_model()
    log_path = OUT / "server.log"
    process = start_server(log_path)
    try:
        ready = time.monotonic()
        cold = asyncio.run(burst())
        time.sleep(max(0.0, 60 - (time.monotonic() - ready)))
        warm = asyncio.run(burst())
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    warmup_line = next((line for line in log_path.read_text().splitlines() if "Warm-up" in line), None)
    result = {
        "cold_ttft_p50_s": percentile(cold, 0.5),
        "cold_ttft_p99_s": percentile(cold, 0.99),
        "warm_ttft_p50_s": percentile(warm, 0.5),
        "warm_ttft_p99_s": percentile(warm, 0.99),
        "warmup_log": warmup_line and re.sub(r"^\S+\s+", "", warmup_line),
    }
    result["ratio_p99"] = result["cold_ttft_p99_s"] / result["warm_ttft_p99_s"]
    result["pass"] = result["ratio_p99"] <= 2.0
    print(json.dumps(result))
    (OUT / "warmup_ttft.json").write_text(json.dumps(result, indent=1))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
