"""The server's Prometheus metrics: TGI's `tgi_*` series plus vLLM's `vllm:*` series.

The HTTP layer calls the `request_*` methods as a request moves through validation, the queue and
generation; the engine's periodic `tgi_compat.router.stats.EngineStats` feeds the batch and KV gauges. Names,
types, labels, buckets and help texts follow TGI's router (see docs/contract.md §11):
counters are bare (`tgi_request_count`, no `_total`), series appear only after first use, every
`*duration` histogram has 35 geometric buckets 0.0001·1.5^k, and `tgi_request_skipped_tokens` is
a summary. The vLLM series are plain prometheus_client metrics with vLLM's names and buckets, so
dashboards written for vLLM-style servers find what they expect.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from tgi_compat.api.observability.durations import RequestDurations
from tgi_compat.api.observability.metrics_tgi import TgiCollector, TgiFamilies
from tgi_compat.api.observability.metrics_vllm import VllmFamilies
from tgi_compat.api.observability.prometheus_text import render_text
from tgi_compat.router.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FAILURE_KINDS = ("validation", "overloaded", "generation", "incomplete", "dropped", "template")
BATCH_METHODS = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Totals and occupancy at one instant, for the periodic stats log line."""

    prompt_tokens: int  # cumulative
    generated_tokens: int  # cumulative
    waiting: int
    running: int
    kv_usage: float | None  # 0..1, None until the engine reports
    prefix_cache_queries: int = 0  # cumulative tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative tokens found there
    cached_tokens: int = 0  # KV slots the prefix cache holds


class ServerMetrics:
    """All metrics of one server. Thread-safe; one instance per API process."""

    def __init__(self, max_input_tokens: int, max_total_tokens: int, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.tgi = TgiFamilies(max_input_tokens, max_total_tokens)
        self.registry.register(TgiCollector(self.tgi))
        self.vllm = VllmFamilies(self.registry, model_name, max_total_tokens)
        self._lock = threading.Lock()
        self._waiting = 0  # API-side view: submitted, no token yet
        self._running = 0  # API-side view: streaming tokens
        self._engine_reported = False  # once the engine reports, its numbers win
        self._preemptions_seen = 0
        self._api_tokens = [0, 0]  # prompt, generated: summed over finished requests
        self._engine_tokens: tuple[int, int] | None = None  # the engine's cumulative counts
        self.max_lora = 0  # LoRA adapters in one step (--max-loras), 0: LoRA off
        self._lora_labels: tuple[str, str, str] | None = None  # lora_requests_info's one series
        self._prefix_cache = (0, 0, 0)  # the engine's cumulative queries, hits; tokens cached now
        self._kv_usage: float | None = None
        self._waiting_engine = self._running_engine = 0

    # -- request lifecycle (HTTP layer) ---------------------------------------------------------
    def request_received(self, count: int = 1) -> None:
        """Once per request as TGI counts them (chat counts twice, completions 1 + one per prompt)."""
        self.tgi.request_count.inc(count)

    def request_failed(self, err: str) -> None:
        if err not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {err!r}; TGI uses {FAILURE_KINDS}")
        self.tgi.request_failure.inc(err=err)

    def record_input_length(self, input_len: int, max_new_tokens: int | None = None) -> None:
        """At validation, as TGI's validation does (`max_new_tokens` once it is resolved)."""
        self.tgi.input_length.observe(float(input_len))
        if max_new_tokens is not None:
            self.record_max_new_tokens(max_new_tokens)

    def record_max_new_tokens(self, max_new_tokens: int) -> None:
        self.tgi.max_new_tokens.observe(float(max_new_tokens))

    def request_succeeded(
        self,
        durations: RequestDurations,
        input_len: int,
        generated_tokens: int,
        max_new_tokens: int,
        *,
        time_to_first_token_s: float | None = None,
        finish_reason: str = "length",
        n: int = 1,
        skipped_tokens: int | None = None,
        adapter: str | None = None,
    ) -> None:
        """One finished generation. `finish_reason` is TGI's (length/eos_token/stop_sequence);
        vLLM's label uses its own words (length/stop). `adapter`: the LoRA adapter it ran under."""
        t = self.tgi
        t.request_success.inc()
        t.request_duration.observe(durations.total_s)
        t.validation_duration.observe(durations.validation_s)
        t.queue_duration.observe(durations.queue_s)
        t.inference_duration.observe(durations.inference_s)
        t.time_per_token.observe(durations.time_per_token_s)
        t.generated_tokens.observe(float(generated_tokens))
        if skipped_tokens is not None:
            t.skipped_tokens.observe(float(skipped_tokens))
        if adapter is not None:
            self.vllm.lora_e2e_latency.labels(self.model_name, adapter).observe(durations.total_s)
        self._record_vllm_request(
            durations.total_s,
            durations.queue_s,
            durations.inference_s,
            durations.time_per_token_s,
            input_len,
            generated_tokens,
            max_new_tokens,
            time_to_first_token_s,
            finish_reason,
            n,
        )

    def _record_vllm_request(
        self,
        total_s: float,
        queue_s: float,
        inference_s: float,
        tpot_s: float,
        input_len: int,
        generated: int,
        max_new: int,
        ttft_s: float | None,
        finish_reason: str,
        n: int,
    ) -> None:
        v, name = self.vllm, self.model_name
        with self._lock:
            self._api_tokens[0] += input_len
            self._api_tokens[1] += generated
        v.prompt_tokens.labels(name).inc(input_len)
        v.generation_tokens.labels(name).inc(generated)
        reason = "length" if finish_reason == "length" else "stop"  # vLLM's words for eos/stop strings
        v.request_success.labels(name, reason).inc()
        v.e2e_latency.labels(name).observe(total_s)
        v.queue_time.labels(name).observe(queue_s)
        v.inference_time.labels(name).observe(inference_s)
        if ttft_s is not None:
            v.ttft.labels(name).observe(ttft_s)
        if generated > 1:
            v.tpot.labels(name).observe(tpot_s)
        v.prompt_tokens_hist.labels(name).observe(input_len)
        v.generation_tokens_hist.labels(name).observe(generated)
        v.params_n.labels(name).observe(n)
        v.params_max_tokens.labels(name).observe(max_new)

    # -- API-side occupancy, used until the engine reports its own -----------------------------
    @contextmanager
    def track_inflight(self) -> Iterator[InflightRequest]:
        """Wrap one generation: counts it as waiting until `first_token()`, then as running."""
        request = InflightRequest(self)
        with self._lock:
            self._waiting += 1
        self._publish_api_occupancy()
        try:
            yield request
        finally:
            with self._lock:
                if request.started:
                    self._running -= 1
                else:
                    self._waiting -= 1
            self._publish_api_occupancy()

    def _mark_running(self) -> None:
        with self._lock:
            self._waiting -= 1
            self._running += 1
        self._publish_api_occupancy()

    def _publish_api_occupancy(self) -> None:
        if self._engine_reported:
            return
        with self._lock:
            waiting, running = self._waiting, self._running
        self.tgi.queue_size.set(waiting)
        self.tgi.batch_current_size.set(running)
        self.vllm.num_requests_waiting.labels(self.model_name).set(waiting)
        self.vllm.num_requests_running.labels(self.model_name).set(running)

    # -- engine side ---------------------------------------------------------------------------
    def set_max_batch_total_tokens(self, tokens: int) -> None:
        """The KV capacity found at warmup (TGI sets it once, after warmup)."""
        self.tgi.batch_max_total_tokens.set(tokens)

    def set_lora_count(self, count: int) -> None:
        """The LoRA adapters loaded (at startup, and after each runtime load or unload)."""
        self.vllm.lora_count.labels(self.model_name).set(count)

    def adapter_unloaded(self, name: str) -> None:
        """An adapter's latency series goes with it: a server that cycles through many adapters at runtime would
        otherwise keep a histogram for every name it ever served."""
        self.vllm.lora_e2e_latency.remove(self.model_name, name)

    def set_engine_stats(
        self,
        queue_size: int,
        batch_size: int,
        batch_max_tokens: int,
        kv_used: int,
        kv_total: int,
        num_preemptions: int | None = None,
        running_lora_adapters: Sequence[str] = (),
        waiting_lora_adapters: Sequence[str] = (),
    ) -> None:
        """Engine occupancy. `num_preemptions` is the engine's cumulative count."""
        self._engine_reported = True
        name = self.model_name
        self.tgi.queue_size.set(queue_size)
        self.tgi.batch_current_size.set(batch_size)
        self.tgi.batch_current_max_tokens.set(batch_max_tokens)
        self.vllm.num_requests_waiting.labels(name).set(queue_size)
        self.vllm.num_requests_running.labels(name).set(batch_size)
        usage = kv_used / kv_total if kv_total > 0 else 0.0
        self._kv_usage = usage
        with self._lock:
            self._waiting_engine, self._running_engine = queue_size, batch_size
        self.vllm.gpu_cache_usage.labels(name).set(usage)
        self.vllm.kv_cache_usage.labels(name).set(usage)
        lora_labels = str(self.max_lora), ",".join(waiting_lora_adapters), ",".join(running_lora_adapters)
        self.vllm.lora_requests_info.labels(*lora_labels).set_to_current_time()
        # the newest series alone, which is what the router reads: vLLM keeps every one it has reported, and
        # adapter lists in first-seen order make those without bound (8 adapters: ~10^5 orders each way)
        with self._lock:
            previous, self._lora_labels = self._lora_labels, lora_labels
        if previous is not None and previous != lora_labels:
            self.vllm.lora_requests_info.remove(*previous)
        if num_preemptions is not None:
            with self._lock:
                new = num_preemptions - self._preemptions_seen
                self._preemptions_seen = max(self._preemptions_seen, num_preemptions)
            if new > 0:
                self.vllm.num_preemptions.labels(name).inc(new)

    def apply_engine_stats(self, stats: EngineStats) -> None:
        """Everything one EngineStats message carries: occupancy plus the steps since the last one."""
        self.set_engine_stats(
            stats.queue_size,
            stats.running,
            stats.batch_max_tokens,
            stats.kv_used,
            stats.kv_total,
            stats.num_preemptions,
            stats.running_lora_adapters,
            stats.waiting_lora_adapters,
        )
        if stats.prompt_tokens or stats.generated_tokens:
            self._engine_tokens = (stats.prompt_tokens, stats.generated_tokens)
        self._apply_prefix_cache_stats(stats.prefix_cache_queries, stats.prefix_cache_hits, stats.kv_cached)
        self.vllm.spec_decode.apply(stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
        if stats.kv_total and self.tgi.batch_max_total_tokens.value() is None:
            self.set_max_batch_total_tokens(stats.kv_total)
        for step in stats.steps:
            self.record_batch_step(
                step.method, step.forward_s, step.decode_s, step.total_s, ok=step.ok, new_batch_size=step.new_batch_size
            )

    def _apply_prefix_cache_stats(self, queries: int, hits: int, cached: int) -> None:
        """The engine's cumulative counts become increments of the vllm:prefix_cache_* counters."""
        with self._lock:
            seen_queries, seen_hits, _ = self._prefix_cache
            self._prefix_cache = (max(queries, seen_queries), max(hits, seen_hits), cached)
        if queries > seen_queries:
            self.vllm.prefix_cache_queries.labels(self.model_name).inc(queries - seen_queries)
        if hits > seen_hits:
            self.vllm.prefix_cache_hits.labels(self.model_name).inc(hits - seen_hits)

    def record_batch_step(
        self,
        method: str,
        forward_s: float,
        decode_s: float,
        total_s: float,
        *,
        ok: bool = True,
        new_batch_size: int = 0,
    ) -> None:
        """One engine step (`method` prefill or decode), as TGI's backend records a shard call."""
        if method not in BATCH_METHODS:
            raise ValueError(f"method must be one of {BATCH_METHODS}")
        t = self.tgi
        t.batch_inference_count.inc(method=method)
        if new_batch_size:
            t.batch_next_size.observe(float(new_batch_size))
        if not ok:
            t.batch_inference_failure.inc(method=method)
            return
        t.batch_forward_duration.observe(forward_s, method=method)
        t.batch_decode_duration.observe(decode_s, method=method)
        t.batch_filter_duration.observe(max(0.0, total_s - forward_s - decode_s), method=method)
        t.batch_inference_duration.observe(total_s, method=method)
        t.batch_inference_success.inc(method=method)

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            prompt, generated = self._engine_tokens or tuple(self._api_tokens)
            if self._engine_reported:
                waiting, running = self._waiting_engine, self._running_engine
            else:
                waiting, running = self._waiting, self._running
            queries, hits, cached = self._prefix_cache
        return MetricsSnapshot(
            prompt_tokens=prompt,
            generated_tokens=generated,
            waiting=waiting,
            running=running,
            kv_usage=self._kv_usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            cached_tokens=cached,
        )

    # -- exposition ----------------------------------------------------------------------------
    def render(self) -> bytes:
        """The `/metrics` body (also what the push gateway receives)."""
        return render_text(self.registry.collect())


class InflightRequest:
    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self.started = False

    def first_token(self) -> None:
        if not self.started:
            self.started = True
            self._metrics._mark_running()
