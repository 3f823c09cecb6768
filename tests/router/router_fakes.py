"""Hand-made model outputs for CPU router tests (vLLM's scheduler tests do the same)."""

from __future__ import annotations

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.router.admission import AdmissionLimits
from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.request import GenerateRequest, Request, SamplingParams
from tgi_compat.router.scheduler import Scheduler, SchedulerLimits
from tgi_compat.router.step import PromptScores, SampledToken, StepPlan, StepResult

EOS = 2


def make_scheduler(
    num_slots: int = 1000,
    max_running: int = 16,
    max_prefill: int = 512,
    token_ratio: float = 0.0,
    max_new_estimate: int = 1024,
) -> Scheduler:
    limits = SchedulerLimits(max_prefill, AdmissionLimits(num_slots, max_running, token_ratio, max_new_estimate))
    return Scheduler(KVSlotPool(num_slots, max_running), limits, frozenset({EOS}))


_arrivals = iter(range(1_000_000))


def make_request(request_id: str, num_prompt: int = 8, max_new: int = 4, **kwargs) -> Request:
    params = GenerateRequest(request_id, list(range(10, 10 + num_prompt)), max_new_tokens=max_new, **kwargs)
    return Request(params, arrival=next(_arrivals))


def result_for(plan: StepPlan, next_token=lambda request: 100 + len(request.output_ids)) -> StepResult:
    """The StepResult a model would return: `next_token(request)` for sampled chunks."""
    tokens = [SampledToken(next_token(c.request), -0.5) if c.is_sampled else None for c in plan.chunks]
    scores = [
        None
        if c.num_prompt_logprob_rows is None
        else PromptScores([-1.0 * (c.start + i + 1) for i in range(c.num_prompt_logprob_rows)])
        for c in plan.chunks
    ]
    return StepResult(tokens=tokens, prompt_scores=scores)


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000, **kwargs) -> dict[str, list]:
    """Step until idle; returns every event per request id. Asserts the pool is full again."""
    events: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        for event in scheduler.update(plan, result_for(plan, **kwargs)):
            events.setdefault(event.request_id, []).append(event)
    assert not scheduler.has_unfinished(), "requests left after max_steps"
    assert scheduler.pool.is_full_free()
    return events


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**kwargs)


class HashRunner:
    """A stand-in model that reads its context only through the KV slots, like a real one.

    Each forward stores the new token ids in their slots and maps positions through its own
    req_to_token table, so a wrong slot, row or position changes the output. The "prediction"
    after a context is a fixed function of all its ids: a request gives the same tokens alone,
    batched, chunked or after a preemption, exactly when the router's bookkeeping is right.
    """

    def __init__(self, num_kv_slots: int = 4096, max_rows: int = 64, max_len: int = 2048, vocab: int = 64) -> None:
        self.num_kv_slots = num_kv_slots
        self.max_seq_len = max_len
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.vocab = vocab
        self.kv = torch.full((num_kv_slots,), -1, dtype=torch.int64)
        self.req_to_token = torch.zeros(max_rows, max_len, dtype=torch.int64)
        self.fail_on_token: int | None = None  # a batch holding this id makes forward raise (use 0)
        self.num_forwards = 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.num_forwards += 1
        if self.fail_on_token is not None and bool((batch.input_ids == self.fail_on_token).any()):
            raise RuntimeError("poisoned token")
        if batch.cached_prefix_slots is not None:  # prefix-cache hits, as ModelRunner.forward writes them
            hit_rows, hit_positions, hit_slots = batch.cached_prefix_slots
            self.req_to_token[hit_rows, hit_positions] = hit_slots
        rows = batch.req_rows.repeat_interleave(batch.q_lens)  # [T]
        self.req_to_token[rows, batch.positions] = batch.out_slots
        self.kv[batch.out_slots] = batch.input_ids
        logits = []
        for index in batch.logits_indices.tolist():
            row, position = int(rows[index]), int(batch.positions[index])
            context = self.kv[self.req_to_token[row, : position + 1]]
            assert bool((context >= 0).all()), "read a slot nobody wrote"
            logits.append(self.logits_after(context.tolist()))
        if not logits:
            return torch.zeros(0, self.vocab)
        return torch.stack(logits)

    def logits_after(self, context: list[int]) -> torch.Tensor:
        target = (sum(i * (k + 1) for k, i in enumerate(context)) * 31 + len(context)) % self.vocab
        if target in (0, EOS):
            target = EOS + 1  # greedy runs go to max_new_tokens; id 0 is kept for poisoning
        distance = (torch.arange(self.vocab) - target) % self.vocab
        return -0.25 * distance.float()


def hash_engine(num_kv_slots: int = 4096, max_running: int = 16, max_prefill: int = 512, runner=None, **config):
    """EngineCore over a HashRunner: the real scheduler, sampler and executor, a stand-in model."""
    from types import SimpleNamespace

    from tgi_compat.router.config import EngineConfig
    from tgi_compat.router.engine import EngineCore

    runner = runner or HashRunner(num_kv_slots=num_kv_slots, max_rows=max_running)
    model_config = SimpleNamespace(
        architecture="HashForTests",
        multimodal_architecture=None,
        vocab_size=runner.vocab,
        max_position_embeddings=2048,
        eos_token_ids=[EOS],
    )
    engine_config = EngineConfig(
        model_id="hash", max_running_requests=max_running, max_batch_prefill_tokens=max_prefill, **config
    )
    return EngineCore(engine_config, runner, model_config)


def drain(engine) -> dict[str, list]:
    events: dict[str, list] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    assert engine.pool.is_full_free()
    return events


def drain_events(engine, requests) -> dict[str, list]:
    """`requests` added, then every event of the engine until it has nothing left (drain)."""
    for request in requests:
        engine.add_request(request)
    return drain(engine)
