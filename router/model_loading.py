"""EngineConfig -> modeling's ModelRunner (the only place the router names modeling's loader)."""

from __future__ import annotations

from router.config import EngineConfig


def load_runner(config: EngineConfig):
    from modeling.runner import ModelRunner, RunnerConfig

    runner_config = RunnerConfig(
        model_id=config.model_id,
        revision=config.revision,
        dtype=config.dtype,
        device=config.device,
        attention_backend=config.attention_backend,
        quantize=config.quantize,
        kv_cache_dtype=config.kv_cache_dtype,
        num_kv_slots=config.max_batch_total_tokens,
        memory_fraction=config.cuda_memory_fraction,
        max_rows=config.max_running_requests,
        max_seq_len=config.max_total_tokens,
        cuda_graph_batch_sizes=config.cuda_graphs,
        max_prefill_tokens=config.max_batch_prefill_tokens,
        show_progress=False,
    )
    return ModelRunner(runner_config)
