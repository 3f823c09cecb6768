"""Latency and throughput figures of one benchmark run, computed from client-side timestamps.

Conventions follow vLLM's ``benchmark_serving`` so our numbers sit next to published ones:

* TTFT  = first streamed token chunk - request sent.
* ITL   = every gap between consecutive streamed chunks, pooled over all requests.
* TPOT  = (E2E - TTFT) / (output_tokens - 1), one value per request with >= 2 output tokens.
* E2E   = last chunk (end of stream) - request sent.
* throughput = completed requests or tokens / wall-clock duration of the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Percentiles reported for every latency distribution.
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw for one request. Times are seconds on a shared monotonic clock."""

    prompt_len: int  # prompt tokens as counted by the benchmark's tokenizer
    max_new_tokens: int  # what we asked for (= reference output length)
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    end_time: float = 0.0
    output_tokens: int = 0  # tokens generated, as reported by the server (or chunks counted)
    server_prompt_tokens: int | None = None  # prompt tokens as reported by the server
    generated_text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.end_time - self.chunk_times[0]) / (self.output_tokens - 1)


def distribution(values_s: list[float] | np.ndarray) -> dict[str, float]:
    """mean / median / p90 / p99 / max / std of seconds, returned in milliseconds."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {"count": 0}
    out = {"count": int(arr.size), "mean_ms": float(arr.mean()), "std_ms": float(arr.std())}
    for p in PERCENTILES:
        # numpy's default linear interpolation, as vLLM uses.
        out["median_ms" if p == 50 else f"p{p}_ms"] = float(np.percentile(arr, p))
    out["max_ms"] = float(arr.max())
    return out


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """The headline figures of one run: counts, throughput, and the four latency distributions."""
    done = [r for r in records if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itls]
    ended_early = [r for r in done if r.output_tokens < r.max_new_tokens]
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "requested_output_tokens": sum(r.max_new_tokens for r in done),
        "ended_early": len(ended_early),
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else 0.0,
        # Little's law: the mean number of requests in flight.
        "mean_concurrency": sum(r.e2e for r in done) / duration_s if duration_s > 0 else 0.0,
        "ttft": distribution([r.ttft for r in done]),
        "tpot": distribution(tpots),
        "itl": distribution(itls),
        "e2e": distribution([r.e2e for r in done]),
    }


def throughput_timeline(records: list[RequestRecord], start: float, bin_s: float) -> dict:
    """Output tokens per second in fixed time bins (one chunk = its share of the request's tokens)."""
    done = [r for r in records if r.ok and r.chunk_times]
    end = max((r.end_time for r in done), default=start)
    num_bins = max(1, int(np.ceil((end - start) / bin_s)))
    tokens = np.zeros(num_bins)
    for r in done:
        # Chunks may carry several tokens (OpenAI servers); spread the count evenly over them.
        per_chunk = r.output_tokens / len(r.chunk_times)
        idx = np.minimum(((np.asarray(r.chunk_times) - start) / bin_s).astype(int), num_bins - 1)
        np.add.at(tokens, idx, per_chunk)
    return {
        "bin_s": bin_s,
        "time_s": (np.arange(num_bins) * bin_s).tolist(),
        "output_tokens_per_s": (tokens / bin_s).tolist(),
    }
