"""What the engine reports about itself, periodically, for metrics and logs.

    engine loop --(every ~0.5 s, or each step when idle->busy)--> EngineStats --> API process
        ServerMetrics.apply_engine_stats(stats)   # tgi_queue_size, tgi_batch_*, vllm:* gauges
        StatsLogger.observe(stats)                 # LightLLM's periodic throughput line

The engine accumulates one StepStats per model step since the last report and clears the list
after sending. Counts that only grow (preemptions, tokens) are cumulative so a lost report
loses nothing.
"""

from __future__ import annotations

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
    steps: list[StepStats] = []  # steps since the previous report


STATS_ENCODER = msgspec.msgpack.Encoder()
STATS_DECODER = msgspec.msgpack.Decoder(EngineStats)
