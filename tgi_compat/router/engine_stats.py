"""Per-step and occupancy numbers the engine reports for metrics (tgi_compat.router.stats is the boundary).

EngineCore records one StepStats per step; the engine loop asks `report()` when a report is due.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.prefix_groups import GroupCounts
from tgi_compat.router.request import Request
from tgi_compat.router.scheduler import Scheduler
from tgi_compat.router.speculative.speculator import SpeculationCounters
from tgi_compat.router.stats import EngineStats, StatsAccumulator, StepStats
from tgi_compat.router.step import StepPlan, StepResult


class EngineStatsTracker:
    def __init__(
        self, scheduler: Scheduler, interval_s: float = 0.5, lora_names: Callable[[int], str] | None = None
    ) -> None:
        self.scheduler = scheduler
        self.lora_names = lora_names  # an adapter id's name (LoRA on)
        self.accumulator = StatsAccumulator(interval_s)
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.group_counts = GroupCounts()  # --diverse_mode: the step builder's, shared (engine.py)

    def record(self, plan: StepPlan, result: StepResult, events: list[TokenEvent], total_s: float) -> None:
        """One applied step; `events` are what update() made of it (tokens of requests that ended
        before it was applied, with overlap scheduling, are dropped there and not counted)."""
        self.num_preemptions += len(plan.preempted)
        if plan.is_empty:
            return
        prompt_tokens, new_batch_size = _prompt_tokens_and_new_requests(plan)
        self.num_prompt_tokens += prompt_tokens
        self.num_generated_tokens += sum(len(event.token_ids) for event in events)
        self.accumulator.add_step(
            StepStats(
                method="prefill" if prompt_tokens else "decode",
                batch_size=len(plan.chunks),
                forward_s=result.forward_s,
                decode_s=result.sample_s,
                total_s=total_s,
                ok=not result.errors,
                new_batch_size=new_batch_size,
            )
        )

    def report(self, force: bool = False) -> EngineStats | None:
        """An EngineStats when one is due, else None. `force`: the engine just went idle, and the
        gauges (queue, batch, KV in use) should read zero now rather than an interval later."""
        if not (force or self.accumulator.due()):
            return None
        scheduler, pool = self.scheduler, self.scheduler.pool
        speculation = SpeculationCounters() if scheduler.speculator is None else scheduler.speculator.counters
        return self.accumulator.flush(
            (self._adapters(scheduler.running), self._adapters(scheduler.waiting)),
            queue_size=len(scheduler.waiting),
            running=len(scheduler.running),
            batch_max_tokens=sum(r.num_prompt_tokens + r.params.max_new_tokens for r in scheduler.running),
            kv_used=pool.num_used_slots,
            kv_total=pool.num_slots,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.num_prompt_tokens,
            generated_tokens=self.num_generated_tokens,
            prefix_cache_queries=pool.num_prefix_queried_tokens,
            prefix_cache_hits=pool.num_prefix_hit_tokens,
            kv_cached=0 if pool.prefix_cache is None else pool.prefix_cache.num_cached_tokens,
            spec_drafts=speculation.num_drafts,
            spec_draft_tokens=speculation.num_draft_tokens,
            spec_accepted_tokens=speculation.num_accepted_tokens,
            diverse_steps=self.group_counts.steps,
            diverse_rows=self.group_counts.rows,
            diverse_grouped_rows=self.group_counts.grouped_rows,
            diverse_groups=self.group_counts.groups,
        )

    def _adapters(self, requests: Iterable[Request]) -> list[str]:
        if self.lora_names is None:
            return []
        return [self.lora_names(i) for i in dict.fromkeys(r.lora_id for r in requests if r.lora_id)]


def _prompt_tokens_and_new_requests(plan: StepPlan) -> tuple[int, int]:
    """Prompt tokens run this step (every chunk but one-token continuations) and chunks starting at 0."""
    prompt_tokens = new_requests = 0
    for chunk in plan.chunks:
        if chunk.start == 0:
            new_requests += 1
            prompt_tokens += chunk.num_tokens
        elif chunk.num_tokens != 1 and not chunk.drafts:  # (a verify chunk generates)
            prompt_tokens += chunk.num_tokens
    return prompt_tokens, new_requests
