"""The /metrics text: TGI's names, types, labels, buckets and quantiles, vLLM's series beside them."""

import itertools
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.prometheus_samples import parse_samples
from tgi_compat.api.observability.durations import RequestDurations
from tgi_compat.api.observability.metrics import ServerMetrics
from tgi_compat.api.observability.metrics_tgi import DURATION_BUCKETS
from tgi_compat.api.observability.metrics_vllm import one_two_five_buckets
from tgi_compat.api.observability.prometheus_text import format_value
from tgi_compat.router.stats import STATS_DECODER, STATS_ENCODER, EngineStats, StepStats

MAX_INPUT, MAX_TOTAL = 1000, 2048


@pytest.fixture
def metrics():
    return ServerMetrics(MAX_INPUT, MAX_TOTAL, model_name="smol")


def lines(metrics: ServerMetrics) -> list[str]:
    return metrics.render().decode().splitlines()


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return parse_samples(metrics.render().decode())


def type_of(metrics: ServerMetrics, name: str) -> str | None:
    for line in lines(metrics):
        if line.startswith(f"# TYPE {name} "):
            return line.split()[-1]
    return None


def feed_one_request(metrics: ServerMetrics) -> None:
    metrics.request_received()
    metrics.record_input_length(12, max_new_tokens=20)
    metrics.request_succeeded(
        RequestDurations(total_s=1.5, validation_s=0.002, queue_s=0.01, inference_s=1.4, time_per_token_s=0.07),
        input_len=12,
        generated_tokens=20,
        max_new_tokens=20,
        time_to_first_token_s=0.2,
        finish_reason="length",
    )


def test_nothing_is_rendered_before_first_use(metrics):
    assert metrics.render() == b""


def test_tgi_counters_are_bare_and_typed_counter(metrics):
    feed_one_request(metrics)
    metrics.request_failed("validation")
    metrics.request_failed("validation")
    metrics.request_failed("overloaded")
    got = samples(metrics)
    assert got[("tgi_request_count", ())] == 1
    assert got[("tgi_request_success", ())] == 1
    assert got[("tgi_request_failure", (("err", "validation"),))] == 2
    assert got[("tgi_request_failure", (("err", "overloaded"),))] == 1
    for name in ("tgi_request_count", "tgi_request_success", "tgi_request_failure"):
        assert type_of(metrics, name) == "counter"
    assert not any(line.split(" ")[0].startswith("tgi_") and "_total" in line for line in lines(metrics))
    assert "# HELP tgi_request_count Total number of requests" in lines(metrics)
    assert not any(
        line.startswith("# HELP tgi_request_failure") for line in lines(metrics)
    )  # TGI leaves it undescribed


def test_unknown_failure_kind_is_refused(metrics):
    with pytest.raises(ValueError):
        metrics.request_failed("bogus")


def test_duration_histograms_use_tgis_35_geometric_buckets(metrics):
    feed_one_request(metrics)
    assert len(DURATION_BUCKETS) == 35
    assert DURATION_BUCKETS[0] == pytest.approx(0.00015)
    assert DURATION_BUCKETS[-1] == pytest.approx(0.0001 * 1.5**35)
    text = lines(metrics)
    # The first bound prints as the Rust exporter prints the f64 0.0001*1.5.
    assert 'tgi_request_duration_bucket{le="0.00015000000000000001"} 0' in text
    got = samples(metrics)
    for name in (
        "tgi_request_duration",
        "tgi_request_validation_duration",
        "tgi_request_queue_duration",
        "tgi_request_inference_duration",
        "tgi_request_mean_time_per_token_duration",
    ):
        assert type_of(metrics, name) == "histogram"
        buckets = [line for line in text if line.startswith(name + "_bucket{")]
        assert len(buckets) == 36  # 35 bounds + +Inf
        assert got[(name + "_count", ())] == 1
    assert got[("tgi_request_duration_sum", ())] == pytest.approx(1.5)
    # cumulative: 1.5 s is above 1.12 and below 1.68
    assert got[("tgi_request_duration_bucket", (("le", "1.122274146401882"),))] == 0
    assert got[("tgi_request_duration_bucket", (("le", "1.683411219602823"),))] == 1
    assert got[("tgi_request_duration_bucket", (("le", "+Inf"),))] == 1


def test_length_histograms_have_linear_buckets_from_the_limits(metrics):
    feed_one_request(metrics)
    got = samples(metrics)
    input_bounds = [line for line in lines(metrics) if line.startswith("tgi_request_input_length_bucket")]
    assert len(input_bounds) == 101
    assert input_bounds[0].startswith('tgi_request_input_length_bucket{le="10"}')  # 1000/100
    assert input_bounds[99].startswith('tgi_request_input_length_bucket{le="1000"}')
    assert got[("tgi_request_input_length_bucket", (("le", "10"),))] == 0
    assert got[("tgi_request_input_length_bucket", (("le", "20"),))] == 1  # 12 tokens
    gen = [line for line in lines(metrics) if line.startswith("tgi_request_generated_tokens_bucket")]
    assert gen[0].startswith('tgi_request_generated_tokens_bucket{le="20.48"}')  # 2048/100
    assert got[("tgi_request_generated_tokens_bucket", (("le", "20.48"),))] == 1  # 20 tokens
    assert got[("tgi_request_max_new_tokens_count", ())] == 1


def test_skipped_tokens_is_a_summary_with_tgis_quantiles(metrics):
    for value in range(11):
        metrics.tgi.skipped_tokens.observe(value)
    assert type_of(metrics, "tgi_request_skipped_tokens") == "summary"
    got = samples(metrics)
    quantiles = {
        q: got[("tgi_request_skipped_tokens", (("quantile", q),))]
        for q in ("0", "0.5", "0.9", "0.95", "0.99", "0.999", "1")
    }
    assert quantiles["0"] == 0 and quantiles["0.5"] == 5 and quantiles["0.9"] == 9 and quantiles["1"] == 10
    assert got[("tgi_request_skipped_tokens_count", ())] == 11
    assert got[("tgi_request_skipped_tokens_sum", ())] == 55


def test_engine_stats_feed_gauges_batch_series_and_vllm(metrics):
    stats = EngineStats(
        queue_size=3,
        running=5,
        batch_max_tokens=900,
        kv_used=250,
        kv_total=1000,
        num_preemptions=2,
        steps=[
            StepStats("prefill", 2, 0.02, 0.001, 0.025, new_batch_size=2),
            StepStats("decode", 5, 0.01, 0.001, 0.012),
            StepStats("decode", 5, 0.0, 0.0, 0.0, ok=False),
        ],
    )
    metrics.apply_engine_stats(STATS_DECODER.decode(STATS_ENCODER.encode(stats)))  # over the wire format
    got = samples(metrics)
    assert got[("tgi_queue_size", ())] == 3
    assert got[("tgi_batch_current_size", ())] == 5
    assert got[("tgi_batch_current_max_tokens", ())] == 900
    assert got[("tgi_batch_max_total_tokens", ())] == 1000
    assert got[("tgi_batch_inference_count", (("method", "prefill"),))] == 1
    assert got[("tgi_batch_inference_count", (("method", "decode"),))] == 2
    assert got[("tgi_batch_inference_success", (("method", "decode"),))] == 1
    assert got[("tgi_batch_inference_failure", (("method", "decode"),))] == 1
    assert got[("tgi_batch_forward_duration_count", (("method", "prefill"),))] == 1
    assert got[("tgi_batch_next_size_bucket", (("le", "1"),))] == 0
    assert got[("tgi_batch_next_size_bucket", (("le", "2"),))] == 1
    assert len([line for line in lines(metrics) if line.startswith("tgi_batch_next_size_bucket")]) == 1025
    assert got[("vllm:num_requests_waiting", (("model_name", "smol"),))] == 3
    assert got[("vllm:num_requests_running", (("model_name", "smol"),))] == 5
    assert got[("vllm:gpu_cache_usage_perc", (("model_name", "smol"),))] == 0.25
    # what the Gateway API Inference Extension (llm-d) reads: a timestamped sample naming no adapters
    lora = (("max_lora", "0"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))
    assert abs(got[("vllm:lora_requests_info", lora)] - time.time()) < 60
    assert got[("vllm:num_preemptions_total", (("model_name", "smol"),))] == 2
    # cumulative preemptions: a later report of 3 adds one, a repeated 3 adds none
    metrics.set_engine_stats(0, 0, 0, 0, 1000, num_preemptions=3)
    metrics.set_engine_stats(0, 0, 0, 0, 1000, num_preemptions=3)
    assert samples(metrics)[("vllm:num_preemptions_total", (("model_name", "smol"),))] == 3


def test_lora_requests_info_names_the_engines_adapters(metrics):
    """vLLM's shape: a series per (max_lora, waiting, running), valued at the time it was reported; the router reads
    the newest, the only one kept (vLLM keeps every one it has seen: without bound, adapters in first-seen order)."""
    metrics.max_lora = 2
    stats = EngineStats(1, 2, 0, 0, 1000, running_lora_adapters=["a2", "a1"], waiting_lora_adapters=["a3"])
    metrics.apply_engine_stats(STATS_DECODER.decode(STATS_ENCODER.encode(stats)))
    lora = (("max_lora", "2"), ("running_lora_adapters", "a2,a1"), ("waiting_lora_adapters", "a3"))
    assert abs(samples(metrics)[("vllm:lora_requests_info", lora)] - time.time()) < 60
    metrics.apply_engine_stats(EngineStats(0, 0, 0, 0, 1000))
    idle = (("max_lora", "2"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))
    got = {labels: value for (name, labels), value in samples(metrics).items() if name == "vllm:lora_requests_info"}
    assert list(got) == [idle] and abs(got[idle] - time.time()) < 60
    for order in itertools.permutations(["a1", "a2", "a3", "a4"]):
        metrics.apply_engine_stats(EngineStats(0, len(order), 0, 0, 1000, running_lora_adapters=list(order)))
    got = {labels: value for (name, labels), value in samples(metrics).items() if name == "vllm:lora_requests_info"}
    assert list(got) == [(("max_lora", "2"), ("running_lora_adapters", "a4,a3,a2,a1"), ("waiting_lora_adapters", ""))]


def test_an_unloaded_adapters_latency_series_goes_with_it(metrics):
    durations = RequestDurations(total_s=1.5, validation_s=0.0, queue_s=0.0, inference_s=1.5, time_per_token_s=0.1)
    for name in ("a1", "a2"):
        metrics.request_succeeded(durations, 4, 8, 8, adapter=name)

    def adapters() -> set[str]:
        return {
            dict(labels)["lora_name"]
            for (name, labels), _ in samples(metrics).items()
            if name.startswith("vllm:lora_time")
        }

    assert adapters() == {"a1", "a2"}
    metrics.adapter_unloaded("a1")
    metrics.adapter_unloaded("never-loaded")
    assert adapters() == {"a2"}


def test_prefix_cache_counters_follow_the_engines_cumulative_counts(metrics):
    for queries, hits in ((100, 40), (150, 90), (150, 90)):  # a repeated report adds nothing
        stats = EngineStats(0, 0, 0, 0, 1000, prefix_cache_queries=queries, prefix_cache_hits=hits, kv_cached=77)
        metrics.apply_engine_stats(STATS_DECODER.decode(STATS_ENCODER.encode(stats)))
    got = samples(metrics)
    assert got[("vllm:prefix_cache_queries_total", (("model_name", "smol"),))] == 150
    assert got[("vllm:prefix_cache_hits_total", (("model_name", "smol"),))] == 90
    snapshot = metrics.snapshot()
    assert (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits, snapshot.cached_tokens) == (150, 90, 77)


def test_spec_decode_counters_follow_the_engines_cumulative_counts(metrics):
    for drafts, draft_tokens, accepted in ((10, 40, 25), (12, 48, 30), (12, 48, 30)):
        stats = EngineStats(0, 0, 0, 0, 1000, spec_drafts=drafts, spec_draft_tokens=draft_tokens)
        stats.spec_accepted_tokens = accepted
        metrics.apply_engine_stats(STATS_DECODER.decode(STATS_ENCODER.encode(stats)))
    got = samples(metrics)
    model = (("model_name", "smol"),)
    assert got[("vllm:spec_decode_num_drafts_total", model)] == 12
    assert got[("vllm:spec_decode_num_draft_tokens_total", model)] == 48
    assert got[("vllm:spec_decode_num_accepted_tokens_total", model)] == 30


def test_api_side_occupancy_until_the_engine_reports(metrics):
    with metrics.track_inflight() as first, metrics.track_inflight():
        got = samples(metrics)
        assert got[("tgi_queue_size", ())] == 2 and got[("tgi_batch_current_size", ())] == 0
        first.first_token()
        got = samples(metrics)
        assert got[("tgi_queue_size", ())] == 1 and got[("tgi_batch_current_size", ())] == 1
    got = samples(metrics)
    assert got[("tgi_queue_size", ())] == 0 and got[("tgi_batch_current_size", ())] == 0


def test_vllm_series_follow_a_request(metrics):
    feed_one_request(metrics)
    got = samples(metrics)
    label = (("model_name", "smol"),)
    assert got[("vllm:prompt_tokens_total", label)] == 12
    assert got[("vllm:generation_tokens_total", label)] == 20
    assert got[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "smol")))] == 1
    assert got[("vllm:e2e_request_latency_seconds_sum", label)] == pytest.approx(1.5)
    assert got[("vllm:time_to_first_token_seconds_count", label)] == 1
    assert got[("vllm:time_per_output_token_seconds_count", label)] == 1
    assert (
        got[("vllm:request_params_n_bucket", (("le", "1.0"), ("model_name", "smol")))] == 1
    )  # prometheus_client spells le as vLLM shows it
    assert type_of(metrics, "vllm:prompt_tokens_total") == "counter"
    assert one_two_five_buckets(2048)[-1] == 2000


def test_exposition_parses_as_prometheus_text(metrics):
    feed_one_request(metrics)
    metrics.request_failed("generation")
    metrics.tgi.skipped_tokens.observe(1)
    families = {f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())}
    assert families["tgi_request_duration"] == "histogram"
    assert families["tgi_request_skipped_tokens"] == "summary"
    assert families["vllm:e2e_request_latency_seconds"] == "histogram"


@pytest.mark.parametrize(
    "value,text",
    [(10.0, "10"), (0.5, "0.5"), (1e-05, "0.00001"), (float("inf"), "+Inf"), (20.48, "20.48"), (3, "3")],
)
def test_numbers_print_like_rust(value, text):
    assert format_value(value) == text
