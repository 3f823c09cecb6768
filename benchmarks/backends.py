"""Streaming HTTP clients for the two wire protocols the benchmark speaks.

* ``tgi``:    POST {base}/generate_stream, one SSE event per token, final event with ``details``.
* ``openai``: POST {base}/v1/completions with ``stream: true``; chunks may hold several tokens, so the
  token count comes from ``usage`` (TGI, vLLM, SGLang send it) and falls back to the number of chunks.

Each call fills a ``RequestRecord`` with the arrival time of every chunk; nothing here computes metrics.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from benchmarks.metrics import RequestRecord


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class BackendOptions:
    base_url: str
    model: str = "tgi"  # the OpenAI ``model`` field
    temperature: float = 0.0  # 0 = greedy
    ignore_eos: bool = False  # vendor extension (vLLM, SGLang); TGI has no such parameter
    tgi_details: bool = True  # ask for TGI's final `details` (servers that refuse the parameter: False)


async def _sse_payloads(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """Yield (arrival time, data payload) for each SSE ``data:`` line, as soon as it is read."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield time.perf_counter(), line[len("data:") :].strip()


def _tgi_body(spec: RequestSpec, opts: BackendOptions) -> dict:
    params: dict = {"max_new_tokens": spec.max_new_tokens}
    if opts.tgi_details:
        params["details"] = True
    if opts.temperature > 0:
        params.update(do_sample=True, temperature=opts.temperature)
    return {"inputs": spec.prompt, "parameters": params}


def _openai_body(spec: RequestSpec, opts: BackendOptions) -> dict:
    body = {
        "model": opts.model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_new_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


def _fail(record: RequestRecord, message: str) -> RequestRecord:
    record.error = message
    record.end_time = time.perf_counter()
    return record


async def _consume_tgi(resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
    async for arrival, data in _sse_payloads(resp):
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"{event.get('error_type')}: {event['error']}")
        record.chunk_times.append(arrival)
        if event.get("generated_text") is not None:
            record.generated_text = event["generated_text"]
            details = event.get("details") or {}
            record.finish_reason = details.get("finish_reason")
            record.server_prompt_tokens = details.get("input_length")
            # One event per token; prefer the server's count when it sends one.
            record.output_tokens = details.get("generated_tokens", len(record.chunk_times))
    if record.output_tokens == 0:
        record.output_tokens = len(record.chunk_times)


async def _consume_openai(resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
    texts: list[str] = []
    async for arrival, data in _sse_payloads(resp):
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("error"):
            raise RuntimeError(str(event["error"]))
        for choice in event.get("choices") or []:
            record.chunk_times.append(arrival)
            texts.append(choice.get("text", ""))
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            record.output_tokens = usage.get("completion_tokens", 0)
            record.server_prompt_tokens = usage.get("prompt_tokens")
    record.generated_text = "".join(texts)
    if record.output_tokens == 0:
        record.output_tokens = len(record.chunk_times)


async def send_request(
    session: aiohttp.ClientSession, backend: str, spec: RequestSpec, opts: BackendOptions
) -> RequestRecord:
    """Send one streaming request and time every chunk. Errors are recorded, never raised."""
    record = RequestRecord(prompt_len=spec.prompt_len, max_new_tokens=spec.max_new_tokens)
    if backend == "tgi":
        url, body, consume = f"{opts.base_url}/generate_stream", _tgi_body(spec, opts), _consume_tgi
    elif backend == "openai":
        url, body, consume = f"{opts.base_url}/v1/completions", _openai_body(spec, opts), _consume_openai
    else:
        raise ValueError(f"unknown backend {backend!r}")
    record.send_time = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return _fail(record, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            await consume(resp, record)
    except Exception as exc:  # a failed request is a data point, not a crash
        return _fail(record, f"{type(exc).__name__}: {exc}")
    record.end_time = time.perf_counter()
    if not record.chunk_times:
        record.error = "stream ended without tokens"
    return record


def make_session(timeout_s: float = 6 * 3600) -> aiohttp.ClientSession:
    """One session for the whole run; no connection cap so concurrency is set by the benchmark only."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        read_bufsize=1 << 20,
    )
