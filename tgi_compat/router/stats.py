"""What the engine reports about itself, periodically, for metrics and logs.

    engine loop --(every ~0.5 s, or each step when idle->busy)--> EngineStats --> API process
        ServerMetrics.apply_engine_stats(stats)   # tgi_queue_size, tgi_batch_*, vllm:* gauges
        StatsLogger.observe(stats)                 # LightLLM's periodic throughput line

The engine accumulates one StepStats per model step since the last report and clears the list
after sending. Counts that only grow (preemptions, tokens) are cumulative so a lost report
loses nothing.
"""

from __future__ import annotations

import time

import msgspec


class StepStats(msgspec.Struct, array_like=True, frozen=True):
    method: str  # "prefill" when the step ran any prompt tokens, else "decode" (TGI's shard methods)
    batch_size: int  # requests in the step
    forward_s: float  # model forward
    decode_s: float  # sampling + turning logits into token events
    total_s: float  # whole step, scheduling included
    ok: bool = True
    new_batch_size: int = 0  # requests admitted by this step (TGI's tgi_batch_next_size)


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True):
    queue_size: int  # waiting requests
    running: int  # requests in the running batch
    batch_max_tokens: int  # tokens the running batch may grow to (prompt + max_new_tokens, summed)
    kv_used: int  # KV slots in use
    kv_total: int  # KV slots in the pool
    num_preemptions: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative prompt tokens prefilled
    generated_tokens: int = 0  # cumulative tokens sampled
    prefix_cache_queries: int = 0  # cumulative tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative tokens found there (not computed again)
    kv_cached: int = 0  # KV slots the prefix cache holds (in use or evictable)
    spec_drafts: int = 0  # cumulative verify chunks (speculative decoding)
    spec_draft_tokens: int = 0  # cumulative draft tokens verified
    spec_accepted_tokens: int = 0  # cumulative draft tokens accepted
    diverse_steps: int = 0  # cumulative --diverse_mode decode steps (tgi_compat.router.prefix_groups.GroupCounts)
    diverse_rows: int = 0  # cumulative: their rows
    diverse_grouped_rows: int = 0  # cumulative: of which in a shared-prefix group
    diverse_groups: int = 0  # cumulative: the groups
    running_lora_adapters: list[str] = []  # the adapters of the running requests, first seen first
    waiting_lora_adapters: list[str] = []  # and of the waiting ones
    steps: list[StepStats] = []  # steps since the previous report


STATS_ENCODER = msgspec.msgpack.Encoder()
STATS_DECODER = msgspec.msgpack.Decoder(EngineStats)


class StatsAccumulator:
    """Collects StepStats in the engine loop and hands out one EngineStats per interval.

    engine loop:   acc.add_step(StepStats(...)) after each step
                   if acc.due(): send(acc.flush(queue_size=..., running=..., ...))
    """

    def __init__(self, interval_s: float = 0.5, max_steps: int = 4096) -> None:
        self.interval_s = interval_s
        self._max_steps = max_steps  # bound memory if the API side stops listening
        self._steps: list[StepStats] = []
        self._last_flush = time.monotonic()
        self._busy_since_flush = False

    def add_step(self, step: StepStats) -> None:
        if len(self._steps) < self._max_steps:
            self._steps.append(step)
        self._busy_since_flush = True

    def due(self, now: float | None = None) -> bool:
        """An interval has passed and something happened (an idle engine reports once, then stays quiet)."""
        now = time.monotonic() if now is None else now
        return self._busy_since_flush and now - self._last_flush >= self.interval_s

    def flush(self, lora_adapters: tuple[list[str], list[str]] | None = None, **occupancy: int) -> EngineStats:
        """EngineStats from the engine's current occupancy (EngineStats' int fields, and the running and the
        waiting requests' LoRA adapters) + the steps."""
        steps, self._steps = self._steps, []
        self._last_flush = time.monotonic()
        self._busy_since_flush = bool(steps)  # one more report after the last step shows the idle state
        running, waiting = lora_adapters or ([], [])
        return EngineStats(steps=steps, running_lora_adapters=running, waiting_lora_adapters=waiting, **occupancy)
