"""Speculation shaped for the GPU, over the stand-in model: steps padded to one draft length (what the runner
replays as verify CUDA graphs), a step-cost table that turns drafts off at 64 rows, synthetic acceptance for
random-weight benchmarks, and the --speculative-config keys that carry them."""

from __future__ import annotations

import json
import random

import pytest
from router_fakes import drain, hash_engine
from test_spec_engine import GREEDY, SAMPLED, LoopRunner, _outputs, _prompts, _run

from tgi_compat.router.request import GenerateRequest, SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.policy import StepCostTable, drafts_may_pay
from tgi_compat.router.speculative.synthetic import SyntheticAcceptance

# (past 64 rows each row costs more than the average one: a tie at 64 would leave the choice to rounding)
H200_LIKE = StepCostTable(rows=(1, 16, 64, 128, 512), seconds=(4.05e-3, 4.3e-3, 6.2e-3, 12.8e-3, 51.2e-3))
CODE_EDIT = SyntheticAcceptance((137.0, 57.0, 20.0, 10.0, 570.0))  # SmolLM2, ngram 1..4, k = 4 (2026-12-04)


class ShapeRecorder(LoopRunner):
    """Records each step's new tokens per request."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.steps: list[tuple[list[int], list[int]]] = []  # (q_lens, kv_lens)

    def forward(self, batch):
        self.steps.append((list(batch.q_lens.tolist()), list(batch.kv_lens.tolist())))
        return super().forward(batch)


def _run_recorded(speculative, prompts, sampling=GREEDY, max_new_tokens=40):
    runner = ShapeRecorder(vocab=32)
    engine = hash_engine(runner=runner, speculative=speculative)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", list(prompt), sampling, max_new_tokens=max_new_tokens))
    return drain(engine), engine, runner


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("table", [None, H200_LIKE], ids=["fixed", "table"])
def test_steps_padded_to_one_draft_length_give_the_plain_tokens(sampling, table):
    prompts = _prompts(12)
    plain, _ = _run(None, prompts, sampling)
    uniform = SpeculativeConfig(4, step_cost=table, uniform_max_batch=16)
    events, engine, runner = _run_recorded(uniform, prompts, sampling)
    assert _outputs(events) == _outputs(plain)
    decode_steps = [q for q, kv in runner.steps if all(k > n for n, k in zip(q, kv))]  # no prompt chunk
    verify_steps = [q for q in decode_steps if max(q) > 1]
    assert verify_steps and all(len(set(q)) == 1 for q in decode_steps)  # one length per step: a graph's shape
    assert any(len(q) > 1 for q in verify_steps)
    counters = engine.scheduler.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens


def test_a_batch_past_the_uniform_limit_drafts_per_request():
    prompts = _prompts(12)
    events, _, runner = _run_recorded(SpeculativeConfig(4, uniform_max_batch=4), prompts)
    assert _outputs(events) == _outputs(_run(None, prompts)[0])
    assert any(len(set(q)) > 1 for q, kv in runner.steps if len(q) > 4 and all(k > n for n, k in zip(q, kv)))


@pytest.mark.parametrize("uniform", [0, 64], ids=["per-request", "uniform"])
def test_a_measured_table_drafts_at_batch_one_and_not_at_64(uniform):
    config = SpeculativeConfig(4, step_cost=H200_LIKE, uniform_max_batch=uniform)
    _, alone, _ = _run_recorded(config, _prompts(1))
    assert alone.scheduler.speculator.counters.num_drafts > 0
    runner = ShapeRecorder(vocab=32)
    engine = hash_engine(runner=runner, speculative=config, max_running=64, max_prefill=2048)
    for i, prompt in enumerate(_prompts(64)):
        engine.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(), max_new_tokens=30))
    drain(engine)
    full_steps = [q for q, _ in runner.steps if len(q) == 64]
    assert len(full_steps) > 20 and all(q == [1] * 64 for q in full_steps[1:])  # (the first: the prompts)


def test_synthetic_acceptance_draws_from_its_distribution():
    rng = random.Random(1)
    draws = [CODE_EDIT.draw(4, rng) for _ in range(20_000)]
    assert sum(draws) / len(draws) == pytest.approx(CODE_EDIT.mean(4), abs=0.03)
    assert CODE_EDIT.mean(4) == pytest.approx((57 + 2 * 20 + 3 * 10 + 4 * 570) / 794)
    capped = [CODE_EDIT.draw(2, rng) for _ in range(20_000)]  # fewer drafts: the mass past them lands on the last
    assert max(capped) == 2 and sum(capped) / len(capped) == pytest.approx(CODE_EDIT.mean(2), abs=0.03)


@pytest.mark.parametrize("uniform", [0, 16], ids=["per-request", "uniform"])
def test_synthetic_acceptance_in_the_engine(uniform):
    """Random weights match no n-gram: the proposer drafts k tokens anyway and the verifier accepts a drawn
    number of them; every request still ends at its length with the pool whole again (drain checks it)."""
    config = SpeculativeConfig(4, synthetic_acceptance=CODE_EDIT, uniform_max_batch=uniform)
    events, engine, _ = _run_recorded(config, _prompts(8), max_new_tokens=300)
    assert all(sum(len(e.token_ids) for e in evs) == 300 for evs in events.values())
    counters = engine.scheduler.speculator.counters
    assert counters.num_draft_tokens >= 3.9 * counters.num_drafts  # (fewer only at each request's end)
    assert counters.num_accepted_tokens / counters.num_drafts == pytest.approx(CODE_EDIT.mean(4), abs=0.15)


def test_speculative_config_json_carries_a_table_and_synthetic_acceptance(tmp_path):
    text = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "step_cost": {"rows": [1, 64, 512], "seconds": [0.004, 0.006, 0.05]},
            "synthetic_acceptance": [1, 0, 3],
        }
    )
    config = SpeculativeConfig.from_vllm_json(text)
    assert config.step_cost == StepCostTable((1, 64, 512), (0.004, 0.006, 0.05))
    assert config.synthetic_acceptance == SyntheticAcceptance((1.0, 0.0, 3.0))
    histogram = tmp_path / "hist.json"
    histogram.write_text("[137, 57, 20, 10, 570]")
    from_file = SpeculativeConfig.from_vllm_json(
        json.dumps({"num_speculative_tokens": 4, "synthetic_acceptance": str(histogram)})
    )
    assert from_file.synthetic_acceptance == CODE_EDIT
    with pytest.raises(ValueError):
        SyntheticAcceptance.parse([0, 0])


def test_the_engine_process_fits_speculation_to_its_runner(tmp_path, monkeypatch):
    """load_engine (the engine process's) and EngineCore.from_config both hand the loaded runner to
    tune_speculation; on the CPU that keeps a configured table and pads nothing (no verify graphs)."""
    from benchmarks.device.speculative import write_model_folder
    from benchmarks.shapes import LLAMA3_TINY
    from tgi_compat.router import model_loading
    from tgi_compat.router.config import EngineConfig
    from tgi_compat.router.engine import EngineCore
    from tgi_compat.router.engine_loop import load_engine

    folder = write_model_folder(tmp_path / "tiny", LLAMA3_TINY)
    config = EngineConfig(
        model_id=str(folder),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        max_batch_total_tokens=1024,
        speculative=SpeculativeConfig(4, step_cost=H200_LIKE),
    )
    tuned = []
    original = model_loading.tune_speculation

    def recording(speculative, runner):
        tuned.append(result := original(speculative, runner))
        return result

    monkeypatch.setattr(model_loading, "tune_speculation", recording)
    for engine in (load_engine(config), EngineCore.from_config(config)):
        assert isinstance(engine, EngineCore) and engine.scheduler.speculator is not None
        assert engine.scheduler.speculator.config == tuned[-1]
        engine.close()
    assert len(tuned) == 2 and all(t.step_cost == H200_LIKE and t.uniform_max_batch == 0 for t in tuned)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("uniform", [0, 64], ids=["per-request", "uniform"])
def test_steps_the_table_turns_drafts_off_in_keep_overlap_scheduling(sampling, uniform):
    """64 requests, 8 of them twice as long: while many run, the table says no draft can pay and the engine
    overlaps its steps; as they finish, it drafts again (synchronously). The tokens are the plain path's."""
    prompts = _prompts(64)

    def run(speculative):
        engine = hash_engine(
            runner=LoopRunner(vocab=32),
            speculative=speculative,
            max_running=64,
            max_prefill=2048,
            overlap_scheduling=True,
        )
        for i, prompt in enumerate(prompts):
            params = SamplingParams(**{n: getattr(sampling, n) for n in SamplingParams.__slots__})
            engine.add_request(
                GenerateRequest(f"r{i}", prompt, params, max_new_tokens=60 if i % 8 == 0 else 30, ignore_eos=True)
            )
        events: dict[str, list] = {}
        overlapped = 0
        while engine.has_unfinished():
            for event in engine.step():
                events.setdefault(event.request_id, []).append(event)
            overlapped += engine._in_flight is not None
        assert engine.pool.is_full_free()
        return events, engine, overlapped

    plain, _, _ = run(None)
    speculated, engine, overlapped = run(SpeculativeConfig(4, step_cost=H200_LIKE, uniform_max_batch=uniform))
    assert _outputs(speculated) == _outputs(plain)
    assert overlapped > 20  # the steps of 64 requests
    assert engine.scheduler.speculator.counters.num_accepted_tokens > 0  # the tail's


@pytest.mark.parametrize("uniform", [0, 32], ids=["per-request", "uniform"])
def test_with_no_draft_accepted_newcomers_neither_draft_nor_stop_overlap(uniform):
    """Every draft rejected (synthetic acceptance): after a few waves of 16 streams the server-wide estimate is
    ~0, so a new wave of 16 (at 0.5 each of them would pay for drafts at this batch) drafts nothing, and every
    step that runs them is told no draft may pay (`may_pay`: the engine overlaps those steps)."""
    none_accepted = SyntheticAcceptance((1.0, 0.0, 0.0, 0.0, 0.0))
    config = SpeculativeConfig(4, step_cost=H200_LIKE, uniform_max_batch=uniform, synthetic_acceptance=none_accepted)
    engine = hash_engine(
        runner=LoopRunner(vocab=32), speculative=config, max_running=32, max_prefill=2048, overlap_scheduling=True
    )
    speculator = engine.scheduler.speculator
    answers: list[tuple[int, bool]] = []
    may_pay = speculator.may_pay

    def recording(running):
        answers.append((len(running), answer := may_pay(running)))
        return answer

    speculator.may_pay = recording
    assert drafts_may_pay(16, 0.5, 4, H200_LIKE)
    for wave in range(4):  # three waves of warm-up, then the newcomers (the counts below: from its start)
        drafted, asked = speculator.counters.num_draft_tokens, len(answers)
        for i, prompt in enumerate(_prompts(16)):  # (a new first id: no prefix-cache hit across waves)
            params = SamplingParams()
            engine.add_request(GenerateRequest(f"w{wave}r{i}", [wave, *prompt], params, max_new_tokens=20))
        drain(engine)
    assert speculator.counters.num_draft_tokens == drafted
    assert all(not answer for running, answer in answers[asked:] if running)  # (empty: before they are admitted)
    assert len(answers[asked:]) > 20 and speculator.estimate.rate < 0.05
