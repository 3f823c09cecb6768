"""TGI's `tgi_*` series (its router and v3 backend), declared once with TGI's names, labels, buckets and help
texts, and the collector that exposes those in use; ServerMetrics (metrics.py) records into them, as it does into
vLLM's families (metrics_vllm.py)."""

from __future__ import annotations

from prometheus_client.registry import Collector

from tgi_compat.api.observability.prometheus_text import (
    BareCounter,
    BucketHistogram,
    SetGauge,
    WindowSummary,
    geometric_buckets,
    linear_buckets,
)

DURATION_BUCKETS = geometric_buckets(0.0001, 1.5, 35)
BATCH_SIZE_BUCKETS = [float(k) for k in range(1, 1025)]


class TgiFamilies:
    """Every series of TGI's router and v3 backend, declared once with its TGI help text."""

    def __init__(self, max_input_tokens: int, max_total_tokens: int) -> None:
        def duration(name: str, doc: str = "", labels: tuple[str, ...] = ()) -> BucketHistogram:
            return BucketHistogram(name, doc, DURATION_BUCKETS, labels)

        m = ("method",)
        self.request_count = BareCounter("tgi_request_count", "Total number of requests")
        self.request_success = BareCounter("tgi_request_success", "Number of successful requests")
        self.request_failure = BareCounter("tgi_request_failure", "", ("err",))
        self.request_duration = duration("tgi_request_duration", "Request duration")
        self.validation_duration = duration("tgi_request_validation_duration", "Request validation duration")
        self.queue_duration = duration("tgi_request_queue_duration", "Request queue duration")
        self.inference_duration = duration("tgi_request_inference_duration", "Request inference duration")
        self.time_per_token = duration("tgi_request_mean_time_per_token_duration", "Mean time per token per request")
        self.generated_tokens = BucketHistogram(
            "tgi_request_generated_tokens", "Generated tokens per request", linear_buckets(max_total_tokens)
        )
        self.input_length = BucketHistogram(
            "tgi_request_input_length", "Input token length per request", linear_buckets(max_input_tokens)
        )
        self.max_new_tokens = BucketHistogram(
            "tgi_request_max_new_tokens", "Maximum new tokens per request", linear_buckets(max_total_tokens)
        )
        self.skipped_tokens = WindowSummary("tgi_request_skipped_tokens", "Speculated tokens per request")
        self.queue_size = SetGauge("tgi_queue_size", "Current queue size")
        self.batch_current_size = SetGauge("tgi_batch_current_size", "Current batch size")
        self.batch_current_max_tokens = SetGauge("tgi_batch_current_max_tokens", "Maximum tokens for the current batch")
        self.batch_max_total_tokens = SetGauge("tgi_batch_max_total_tokens", "")
        self.batch_next_size = BucketHistogram(
            "tgi_batch_next_size", "Batch size of the next batch", BATCH_SIZE_BUCKETS
        )
        self.batch_inference_count = BareCounter(
            "tgi_batch_inference_count", "Inference calls per method (prefill or decode)", m
        )
        self.batch_inference_success = BareCounter(
            "tgi_batch_inference_success", "Number of successful inference calls per method (prefill or decode)", m
        )
        self.batch_inference_failure = BareCounter("tgi_batch_inference_failure", "", m)
        self.batch_inference_duration = duration("tgi_batch_inference_duration", "Batch inference duration", m)
        self.batch_forward_duration = duration(
            "tgi_batch_forward_duration", "Batch forward duration per method (prefill or decode)", m
        )
        self.batch_decode_duration = duration(
            "tgi_batch_decode_duration", "Time spent decoding a batch per method (prefill or decode)", m
        )
        self.batch_filter_duration = duration(
            "tgi_batch_filter_duration",
            "Time spent filtering batches and sending generated tokens per method (prefill or decode)",
            m,
        )
        self.batch_concat = BareCounter("tgi_batch_concat", "", ("reason",))
        self.batch_concat_duration = duration("tgi_batch_concat_duration", "", m)

    def all(self) -> list:
        return list(vars(self).values())


class TgiCollector(Collector):
    def __init__(self, families: TgiFamilies) -> None:
        self._families = families

    def collect(self):
        for family in self._families.all():
            metric = family.to_metric()
            if metric is not None:
                yield metric
