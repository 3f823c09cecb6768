"""Scheduler against hand-made model outputs: admission, chunking, preemption, abort, stopping."""

from __future__ import annotations

from router_fakes import EOS, make_request, make_scheduler, result_for, run_to_completion

from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.request import FinishReason, RequestStatus
from tgi_compat.router.scheduler import Scheduler, SchedulerLimits


def test_requests_finish_with_their_tokens_and_the_pool_is_full_again():
    scheduler = make_scheduler()
    for i in range(3):
        scheduler.add(make_request(f"r{i}", num_prompt=5 + i, max_new=3))
    events = run_to_completion(scheduler)
    for i in range(3):
        assert [e.token_ids[0] for e in events[f"r{i}"]] == [100, 101, 102]
        assert events[f"r{i}"][-1].finish_reason == "length"
        assert events[f"r{i}"][0].num_prompt_tokens == 5 + i


def test_max_running_requests_caps_admission():
    scheduler = make_scheduler(max_running=2)
    for i in range(3):
        scheduler.add(make_request(f"r{i}"))
    plan = scheduler.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    scheduler.update(plan, result_for(plan))
    run_to_completion(scheduler)


def test_future_memory_estimate_holds_back_a_request_that_could_run_out():
    # Each request needs 8 + 10 = 18 slots at its peak; 40 slots fit two (peak 36), not three.
    scheduler = make_scheduler(num_slots=40)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", num_prompt=8, max_new=10))
    plan = scheduler.schedule()
    assert len(plan.chunks) == 2
    first = scheduler.update(plan, result_for(plan))
    events = run_to_completion(scheduler)
    assert [e.request_id for e in first] == ["r0", "r1"]
    assert len(events["r0"]) == len(events["r1"]) == 9 and len(events["r2"]) == 10


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    scheduler = make_scheduler(max_prefill=4)
    scheduler.add(make_request("short", num_prompt=3, max_new=6))
    plan = scheduler.schedule()  # short's prefill takes 3 of the 4 budget tokens
    scheduler.update(plan, result_for(plan))
    scheduler.add(make_request("long", num_prompt=10, max_new=2))
    shapes = []
    for _ in range(4):
        plan = scheduler.schedule()
        shapes.append([(c.request.request_id, c.start, c.num_tokens, c.is_sampled) for c in plan.chunks])
        scheduler.update(plan, result_for(plan))
    assert shapes == [
        [("short", 3, 1, True), ("long", 0, 4, False)],
        [("short", 4, 1, True), ("long", 4, 4, False)],
        [("short", 5, 1, True), ("long", 8, 2, True)],
        [("short", 6, 1, True), ("long", 10, 1, True)],
    ]
    run_to_completion(scheduler)


def test_prefill_budget_is_shared_between_new_requests():
    scheduler = make_scheduler(max_prefill=10)
    scheduler.add(make_request("a", num_prompt=6))
    scheduler.add(make_request("b", num_prompt=6))
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 6), ("b", 4)]
    scheduler.update(plan, result_for(plan))
    run_to_completion(scheduler)


def test_a_step_that_decodes_takes_at_most_the_mixed_prefill_budget():
    """--max-mixed-prefill-tokens 4: beside decoding requests a joining prompt advances 4 tokens a step (the
    streams wait for shorter steps); with nothing decoding, prompts take the whole budget of 16."""
    base = make_scheduler()
    limits = SchedulerLimits(16, base.limits.admission, max_mixed_prefill_tokens=4)
    scheduler = Scheduler(KVSlotPool(1000, 16), limits, frozenset({EOS}))
    scheduler.add(make_request("a", num_prompt=6, max_new=8))
    scheduler.add(make_request("b", num_prompt=12, max_new=8))
    plan = scheduler.schedule()  # nothing decodes yet: 6 + 10 of the 16
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 6), ("b", 10)]
    scheduler.update(plan, result_for(plan))
    scheduler.add(make_request("c", num_prompt=9, max_new=2))
    shapes = []
    for _ in range(3):
        plan = scheduler.schedule()
        shapes.append([(c.request.request_id, c.num_tokens) for c in plan.chunks])
        scheduler.update(plan, result_for(plan))
    assert shapes == [
        [("a", 1), ("b", 2), ("c", 2)],  # b's last 2 prompt tokens and c's first 2: 4 beside a's decode
        [("a", 1), ("b", 1), ("c", 4)],
        [("a", 1), ("b", 1), ("c", 3)],
    ]
    run_to_completion(scheduler)


def test_newest_request_is_preempted_and_resumes_with_prompt_and_generated_tokens():
    # Optimistic admission (ratio 1.0 -> never busy, estimate 2 new tokens) over-admits on purpose.
    scheduler = make_scheduler(num_slots=24, token_ratio=1.0, max_new_estimate=2)
    scheduler.add(make_request("old", num_prompt=8, max_new=8))
    scheduler.add(make_request("new", num_prompt=8, max_new=8))
    preempted_at = None
    all_events: dict[str, list] = {}
    for step in range(100):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        if plan.preempted and preempted_at is None:
            preempted_at = step
            assert [r.request_id for r in plan.preempted] == ["new"]
            victim = plan.preempted[0]
            assert victim.status is RequestStatus.PREEMPTED and victim.slots == []
            assert scheduler.waiting[0] is victim and victim.num_computed_tokens == 0
            num_generated = len(victim.output_ids)
            assert num_generated > 0
        resumed = [
            c for c in plan.chunks if c.request.request_id == "new" and c.start == 0 and preempted_at is not None
        ]
        if resumed:  # re-prefill covers the prompt and every generated token
            assert resumed[0].num_tokens == 8 + num_generated
        for event in scheduler.update(plan, result_for(plan)):
            all_events.setdefault(event.request_id, []).append(event)
    assert preempted_at is not None
    for request_id in ("old", "new"):
        assert [e.token_ids[0] for e in all_events[request_id]] == list(range(100, 108))
    assert scheduler.pool.is_full_free()


def test_abort_frees_slots_at_the_next_step():
    scheduler = make_scheduler(num_slots=100)
    scheduler.add(make_request("a", num_prompt=8, max_new=50))
    scheduler.add(make_request("waiting", num_prompt=8, max_new=50))  # 8+50 twice > 100: waits
    plan = scheduler.schedule()
    scheduler.update(plan, result_for(plan))
    assert scheduler.pool.num_used_slots == 8
    scheduler.abort("a")
    scheduler.abort("waiting")
    plan = scheduler.schedule()
    assert plan.is_empty and {r.request_id for r in plan.aborted} == {"a", "waiting"}
    assert scheduler.pool.is_full_free()
    events = scheduler.update(plan, result_for(plan))
    assert sorted((e.request_id, e.finish_reason) for e in events) == [("a", "abort"), ("waiting", "abort")]
    assert not scheduler.has_unfinished()


def test_stop_criteria_follow_tgi_order():
    scheduler = make_scheduler()
    scheduler.add(make_request("eos", max_new=5))
    scheduler.add(make_request("eos-last", max_new=1))  # EOS as the last allowed token -> length
    scheduler.add(make_request("ignore", max_new=3, ignore_eos=True))
    scheduler.add(make_request("stop-id", max_new=5, stop_token_ids=[EOS]))
    scheduler.requests["stop-id"].params.ignore_eos = True
    events = run_to_completion(scheduler, next_token=lambda r: EOS)
    assert events["eos"][-1].finish_reason == FinishReason.EOS_TOKEN.value and len(events["eos"]) == 1
    assert events["eos-last"][-1].finish_reason == "length"
    assert events["ignore"][-1].finish_reason == "length" and len(events["ignore"]) == 3
    assert events["stop-id"][-1].finish_reason == "stop_sequence"


def test_prompt_logprobs_are_sent_once_across_chunks():
    scheduler = make_scheduler(max_prefill=4)
    scheduler.add(make_request("p", num_prompt=10, max_new=2, prompt_logprobs=True))
    events = run_to_completion(scheduler)["p"]
    assert events[0].prompt_logprobs == [None] + [-1.0 * k for k in range(1, 10)]
    assert events[1].prompt_logprobs is None


def test_failed_request_is_finished_alone():
    scheduler = make_scheduler()
    scheduler.add(make_request("ok"))
    scheduler.add(make_request("bad"))
    plan = scheduler.schedule()
    result = result_for(plan)
    result.errors["bad"] = "boom"
    events = {e.request_id: e for e in scheduler.update(plan, result)}
    assert events["bad"].finish_reason == "error" and events["bad"].error == "boom"
    assert events["ok"].finish_reason is None
    run_to_completion(scheduler)


def test_a_request_ending_in_flight_keeps_the_hold_on_late_requests():
    """Overlap scheduling: a request whose pending token is its last by length is left out of the
    next decode step, which stays a decode step, so a late arrival is still held for 3 decode steps
    (it used to join at once, at step 2, where r0 reaches its cap)."""
    base = make_scheduler()
    limits = SchedulerLimits(base.limits.max_batch_prefill_tokens, base.limits.admission, 3, 0.3)
    scheduler = Scheduler(KVSlotPool(1000, 16), limits, frozenset({EOS}))
    for i in range(7):
        scheduler.add(make_request(f"r{i}", max_new=2 if i == 0 else 20))
    previous = scheduler.schedule()
    scheduler.tokens_in_flight(previous, list(range(7)))
    scheduler.add(make_request("late", max_new=4))
    admitted_at = []
    for step in range(1, 5):  # schedule N, update N-1, N's tokens in flight (tgi_compat/router/engine.py's order)
        plan = scheduler.schedule()
        if any(c.request.request_id == "late" and c.start == 0 for c in plan.chunks):
            admitted_at.append(step)
        if step > 1:  # r0's pending token is its last from step 2 on
            assert "r0" not in {c.request.request_id for c in plan.chunks}
        scheduler.update(previous, result_for(previous))
        scheduler.tokens_in_flight(plan, [i for i, c in enumerate(plan.chunks) if c.is_sampled])
        previous = plan
    assert admitted_at == [3]
    scheduler.update(previous, result_for(previous))
    run_to_completion(scheduler)


def test_max_waiting_tokens_holds_a_few_late_requests_back_for_that_many_decode_steps():
    """TGI's batching: 1 waiting request beside 7 decoding (fewer than floor(0.3 x 7) = 2) waits 3
    decode steps, then joins; 2 waiting beside 8 (floor(2.4) = 2) join at once."""
    base = make_scheduler()
    limits = SchedulerLimits(base.limits.max_batch_prefill_tokens, base.limits.admission, 3, 0.3)
    scheduler = Scheduler(KVSlotPool(1000, 16), limits, frozenset({EOS}))
    for i in range(7):
        scheduler.add(make_request(f"r{i}", max_new=20))
    plan = scheduler.schedule()
    scheduler.update(plan, result_for(plan))
    scheduler.add(make_request("late", max_new=4))
    admitted_at = []
    for step in range(1, 6):
        plan = scheduler.schedule()
        if any(c.request.request_id == "late" and c.start == 0 for c in plan.chunks):
            admitted_at.append(step)
        scheduler.update(plan, result_for(plan))
    assert admitted_at == [3]
    scheduler.add(make_request("late2", max_new=4))
    scheduler.add(make_request("late3", max_new=4))
    plan = scheduler.schedule()
    assert {c.request.request_id for c in plan.chunks if c.start == 0} == {"late2", "late3"}
    scheduler.update(plan, result_for(plan))
    run_to_completion(scheduler)


def test_a_token_read_from_nan_scores_ends_its_request_with_an_error_and_no_other():
    scheduler = make_scheduler()
    scheduler.add(make_request("nan", max_new=4))
    scheduler.add(make_request("fine", max_new=4))
    plan = scheduler.schedule()
    result = result_for(plan)
    result.tokens[0].logprob = float("nan")  # what log-softmax gives a row holding a NaN or an inf
    events = scheduler.update(plan, result)
    assert [(e.request_id, e.token_ids, e.finish_reason, e.error) for e in events] == [
        ("nan", [], "error", "the scores of the next token are NaN"),
        ("fine", [100], None, None),
    ]
    assert [e.finish_reason for e in run_to_completion(scheduler)["fine"]][-1] == "length"


def test_a_queue_released_by_the_hold_drains_at_the_mixed_budget_without_a_second_hold():
    """--max-mixed-prefill-tokens 8 beside a hold of 4 decode steps: three late 8-token prompts released
    together join one a step, not one per hold (each waiting 4 more steps: a third of the throughput)."""
    base = make_scheduler()
    limits = SchedulerLimits(64, base.limits.admission, 4, 10.0, max_mixed_prefill_tokens=8)
    scheduler = Scheduler(KVSlotPool(1000, 16), limits, frozenset({EOS}))
    for i in range(4):
        scheduler.add(make_request(f"r{i}", max_new=30))
    plan = scheduler.schedule()
    scheduler.update(plan, result_for(plan))
    for i in range(3):
        scheduler.add(make_request(f"late{i}", num_prompt=8, max_new=4))
    joined = {}
    for step in range(1, 12):
        plan = scheduler.schedule()
        for c in plan.chunks:
            if c.request.request_id.startswith("late") and c.start == 0:
                joined[c.request.request_id] = step
        scheduler.update(plan, result_for(plan))
    assert joined == {"late0": 4, "late1": 5, "late2": 6}
    run_to_completion(scheduler)
