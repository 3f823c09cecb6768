"""vLLM's `vllm:*` Prometheus series (names, help texts and buckets of vllm/engine/metrics.py).

Served beside TGI's series so dashboards and autoscalers written for vLLM-style servers read
this server unchanged. These are ordinary prometheus_client
metrics: vLLM's counters do carry the `_total` suffix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's bucket choices (vllm/engine/metrics.py), so its dashboards read the same.
_VLLM_TTFT = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_VLLM_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_VLLM_LATENCY = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


def one_two_five_buckets(maximum: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum` (vLLM's token-count buckets)."""
    bounds: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return bounds
            bounds.append(float(value))
        exponent += 1


class SpecDecodeCounters:
    """vLLM's vllm:spec_decode_* counters, advanced by the engine's cumulative counts (a repeated report adds
    nothing)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.counters = [
            Counter(f"vllm:spec_decode_num_{name}", doc, ["model_name"], registry=registry)
            for name, doc in (
                ("drafts", "Number of spec decoding drafts."),
                ("draft_tokens", "Number of draft tokens."),
                ("accepted_tokens", "Number of accepted tokens."),
            )
        ]
        self._seen = [0, 0, 0]

    def apply(self, drafts: int, draft_tokens: int, accepted_tokens: int) -> None:
        for i, total in enumerate((drafts, draft_tokens, accepted_tokens)):
            if total > self._seen[i]:
                self.counters[i].labels(self.model_name).inc(total - self._seen[i])
                self._seen[i] = total


class VllmFamilies:
    """vLLM's request and engine series, labelled by model_name as vLLM labels them."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_total_tokens: int) -> None:
        labels = ["model_name"]
        token_buckets = one_two_five_buckets(max_total_tokens)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry, multiprocess_mode="livemostrecent")

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.spec_decode = SpecDecodeCounters(registry, model_name)
        # Read with the two above by the Gateway API Inference Extension (llm-d) to route: the sample
        # with the newest value (a timestamp) names the adapters of the running and of the waiting requests
        # (comma separated); max_lora is --max-loras, 0 with LoRA off.
        # Set with the engine's stats (ServerMetrics.set_engine_stats), like the gauges above.
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        # AIAK's LoRA series (its seed names them, no definition at hand): the adapters loaded, and the
        # end-to-end latency of each adapter's requests.
        self.lora_count = gauge("vllm:lora_count", "Number of LoRA adapters loaded.")
        self.lora_e2e_latency = Histogram(
            "vllm:lora_time_e2e_requests",
            "Histogram of end to end request latency in seconds, per LoRA adapter.",
            labels + ["lora_name"],
            registry=registry,
            buckets=_VLLM_LATENCY,
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=registry
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=registry
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=registry,
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", _VLLM_LATENCY
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _VLLM_TTFT
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", _VLLM_TPOT
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _VLLM_LATENCY
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _VLLM_LATENCY,
        )
        self.prompt_tokens_hist = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.generation_tokens_hist = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
