"""tgi_compat.router.stats: the engine-side accumulator and the wire encoding of its reports."""

from tgi_compat.router.stats import STATS_DECODER, STATS_ENCODER, StatsAccumulator, StepStats

OCCUPANCY = dict(queue_size=2, running=3, batch_max_tokens=300, kv_used=120, kv_total=1000, num_preemptions=1)


def test_reports_once_per_interval_while_busy():
    acc = StatsAccumulator(interval_s=10)
    start = acc._last_flush
    assert not acc.due(start + 100)  # nothing happened yet
    acc.add_step(StepStats("prefill", 2, 0.01, 0.001, 0.02, new_batch_size=2))
    acc.add_step(StepStats("decode", 2, 0.005, 0.001, 0.007))
    assert not acc.due(start + 1)
    assert acc.due(start + 10)
    report = STATS_DECODER.decode(STATS_ENCODER.encode(acc.flush(**OCCUPANCY)))
    assert [s.method for s in report.steps] == ["prefill", "decode"]
    assert report.kv_used == 120 and report.num_preemptions == 1
    # one more report after the last step (so the gauges fall back to idle), then quiet
    assert acc.due(acc._last_flush + 10)
    assert acc.flush(**OCCUPANCY).steps == []
    assert not acc.due(acc._last_flush + 100)


def test_step_list_is_bounded():
    acc = StatsAccumulator(interval_s=0, max_steps=3)
    for _ in range(10):
        acc.add_step(StepStats("decode", 1, 0.0, 0.0, 0.0))
    assert len(acc.flush(**OCCUPANCY).steps) == 3
