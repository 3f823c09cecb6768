"""EngineCore: one step = schedule -> execute -> update.

Keep this file minimal. Scheduling lives in scheduler.py, batch building and failure isolation in
executor.py, token selection in sampling.py, checks in validation.py; a feature that needs engine
logic goes there, not here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from router.admission import AdmissionLimits
from router.client_api import EngineInfo
from router.config import EngineConfig
from router.engine_stats import EngineStatsTracker
from router.executor import Runner, StepExecutor
from router.kv_slots import KVSlotPool
from router.outputs import TokenEvent
from router.request import GenerateRequest, Request
from router.scheduler import Scheduler, SchedulerLimits
from router.stats import EngineStats
from router.validation import validate_request


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, model_config) -> None:
        self.config = config
        self.info = engine_info(config, runner, model_config)
        limits = SchedulerLimits(
            max_batch_prefill_tokens=config.max_batch_prefill_tokens,
            admission=AdmissionLimits(
                num_kv_slots=runner.num_kv_slots,
                max_running_requests=config.max_running_requests,
                router_token_ratio=config.router_token_ratio,
                router_max_new_token_len=config.router_max_new_token_len,
            ),
        )
        self.pool = KVSlotPool(runner.num_kv_slots, config.max_running_requests)
        self.scheduler = Scheduler(self.pool, limits, frozenset(self.info.eos_token_ids))
        self.executor = StepExecutor(runner, self.info.vocab_size, self.info.device)
        self.stats = EngineStatsTracker(self.scheduler)
        # Called by each step while its GPU work runs (StepExecutor.execute); the engine process
        # sends and receives there. It may add and abort requests: both take effect at the next
        # schedule(). Its exception is raised once the step is applied.
        self.while_gpu_works: Callable[[], None] | None = None
        self._rng = random.Random(config.seed)
        self._num_arrivals = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Load the model named by the config (modeling.runner) and build the engine around it."""
        from router.model_loading import load_runner

        runner = load_runner(config)
        return cls(config, runner, runner.model_config)

    def add_request(self, params: GenerateRequest) -> None:
        """Validate (RequestRejectedError) and queue; the request waits for admission."""
        validate_request(params, self.info)
        if params.healing_prefix and self.executor.healer is None:
            self.executor.healer = _token_healer(self.config)
        seed = None
        if params.sampling.is_sampling:
            seed = params.sampling.seed if params.sampling.seed is not None else self._rng.getrandbits(64)
        self.scheduler.add(Request(params, arrival=self._num_arrivals, seed=seed))
        self._num_arrivals += 1

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenEvent]:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        result = self.executor.execute(plan, self.while_gpu_works)
        events = self.scheduler.update(plan, result)
        self.stats.record(plan, result, time.perf_counter() - started)
        self.executor.raise_hook_error()
        return events

    def run_once(self) -> tuple[list[TokenEvent], EngineStats | None]:
        """One turn of a host loop (engine process or test thread): a step when there is work, then
        the stats report that is due, sent at once when the engine just went idle so that the
        queue/batch/KV gauges read zero without waiting for the next interval."""
        events, went_idle = [], False
        if self.has_unfinished():
            events = self.step()
            went_idle = not self.has_unfinished()
        return events, self.stats.report(force=went_idle)


def _token_healer(config: EngineConfig):
    """Loads the vocabulary table lazily: servers that never heal never pay for it."""
    from router.token_healing import TokenHealer

    return TokenHealer.for_model(config.model_id, config.revision)


def engine_info(config: EngineConfig, runner: Runner, model_config) -> EngineInfo:
    max_positions = model_config.max_position_embeddings
    # A request's positions must fit the runner's req_to_token rows and leave admission room.
    max_seq_len = getattr(runner, "max_seq_len", max_positions)
    max_total = min(config.max_total_tokens or max_positions, max_seq_len, runner.num_kv_slots - 1)
    eos = tuple(dict.fromkeys([*model_config.eos_token_ids, *config.eos_token_ids]))
    return EngineInfo(
        model_id=config.model_id,
        architecture=model_config.architecture,
        dtype=str(getattr(runner, "dtype", config.dtype or "float32")).removeprefix("torch."),
        device=str(getattr(runner, "device", config.device or "cpu")),
        vocab_size=model_config.vocab_size,
        max_position_embeddings=max_positions,
        num_kv_slots=runner.num_kv_slots,
        max_total_tokens=max_total,
        eos_token_ids=eos,
    )
