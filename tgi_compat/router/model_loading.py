"""EngineConfig -> modeling's ModelRunner (the only place the router names modeling's loader)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.policy import HeadCost, StepCostTable

if TYPE_CHECKING:
    import torch

    from tgi_compat.modeling.models.eagle3 import Eagle3Head
    from tgi_compat.modeling.runner import ModelRunner
    from tgi_compat.router.speculative.eagle3 import Eagle3Drafter

logger = logging.getLogger(__name__)


def load_runner(config: EngineConfig, rank: int = 0, count_step: Callable[[], None] | None = None):
    """The runner of tensor-parallel rank `rank` (0, the scheduling rank, when not sharded). Under
    --num-shard every rank calls this at once; they meet in torch.distributed's rendezvous.
    count_step: rank 0 calls it for each step it sends (tgi_compat.router.rank_heartbeat)."""
    import torch

    from tgi_compat.modeling.parallel import init_tensor_parallel
    from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
    from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

    runner_config = RunnerConfig(
        model_id=config.model_id,
        revision=config.revision,
        dtype=config.dtype,
        device=config.device,
        attention_backend=config.attention_backend,
        quantize=config.quantize,
        kv_cache_dtype=config.kv_cache_dtype,
        load_format=config.load_format,
        num_kv_slots=config.max_batch_total_tokens,
        memory_fraction=config.cuda_memory_fraction,
        max_rows=config.max_running_requests,
        max_seq_len=config.max_total_tokens,
        cuda_graph_batch_sizes=config.cuda_graphs,
        max_prefill_tokens=config.max_batch_prefill_tokens,
        show_progress=False,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        num_speculative_tokens=0 if config.speculative is None else config.speculative.num_speculative_tokens,
        mixed_prefill_tokens=config.max_mixed_prefill_tokens,
        diverse_mode=config.diverse_mode and config.prefix_caching,
        # (EAGLE-3: rank 0 alone reads the target's layers and holds the head; see load_drafter)
        aux_hidden_layers=_eagle3_target_layers(config) if rank == 0 else None,
        reserve_bytes=_draft_model_bytes(config) if rank == 0 else 0,
        image_cache_bytes=config.image_cache_bytes,
    )
    if config.num_shard == 1:
        runner = ModelRunner(runner_config)
        _gpu_host_threads(runner.device)
        return runner
    device = _device(config)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    else:  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.num_shard))
    tp = init_tensor_parallel(rank, config.num_shard, config.master_addr, config.master_port, device)
    runner = ModelRunner(runner_config, tp=tp)
    if rank == 0:
        runner.step_sender = StepBroadcast(tp, on_step=count_step)
        if runner.lora is not None:  # the other ranks get every adapter rank 0 loads, at startup or later
            runner.lora.followers = runner.step_sender
    _gpu_host_threads(runner.device)
    return runner


def _gpu_host_threads(device: torch.device) -> None:
    """One intra-op thread for a GPU engine's host work once its weights are loaded, unless OMP_NUM_THREADS says how
    many (vLLM's workers run so too). That work is launches and small tensors; PyTorch's pool of a thread a core
    turned the engine's host thread slow while the API's image decoders were busy on the same cores. Qwen2.5-VL-7B,
    H100, a burst of 32 1024px images (benchmarks.device.qwen_vl, session 42): with 16 threads the burst's first or
    second encoder call took 84-122 ms of the device's time (the launches, host-bound; ~52 ms otherwise) and TTFT p50
    was 1.96-2.31x text's; with one, 1.88-2.02x, interleaved runs in one call, and text-only decoding unchanged."""
    import torch

    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
        logger.info("PyTorch's intra-op threads: %d -> 1 (a GPU engine's host work)", torch.get_num_threads())
        torch.set_num_threads(1)


def _device(config: EngineConfig) -> torch.device:
    import torch

    return torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _eagle3_target_layers(config: EngineConfig) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head reads (None: no head); a head that does not fit the target stops here."""
    spec = config.speculative
    if spec is None or spec.draft_model is None:
        return None
    from tgi_compat.modeling.models.eagle3_config import Eagle3Config
    from tgi_compat.modeling.source import resolve_model_source
    from tgi_compat.modeling.weights.loader import load_model_config

    target = load_model_config(resolve_model_source(config.model_id, config.revision), config.load_format)
    head = Eagle3Config.from_folder(resolve_model_source(spec.draft_model).folder)
    head.check_target(target)
    return head.target_layers(target.num_layers)


def _draft_model_bytes(config: EngineConfig) -> int:
    """The EAGLE-3 head's checkpoint size (it loads after the runner has sized its KV cache), and under tensor
    parallelism the whole copy of the target's embedding it gets where it has none of its own (load_drafter)."""
    spec = config.speculative
    if spec is None or spec.draft_model is None:
        return 0
    from tgi_compat.modeling.dtypes import resolve_dtype
    from tgi_compat.modeling.models.eagle3_config import has_own_embedding
    from tgi_compat.modeling.source import resolve_model_source
    from tgi_compat.modeling.weights.loader import load_model_config
    from tgi_compat.modeling.weights.safetensors import safetensors_files

    folder = resolve_model_source(spec.draft_model).folder
    head_bytes = sum(os.path.getsize(path) for path in safetensors_files(folder))
    if config.num_shard == 1 or has_own_embedding(folder):
        return head_bytes
    target = load_model_config(resolve_model_source(config.model_id, config.revision), config.load_format)
    item = resolve_dtype(config.dtype, _device(config)).itemsize
    return head_bytes + target.vocab_size * target.hidden_size * item


def load_drafter(config: EngineConfig, runner: ModelRunner) -> Eagle3Drafter | None:
    """The EAGLE-3 head of `--speculative-config '{"method": "eagle3", "model": ...}'` over the loaded target.

    Under tensor parallelism only rank 0 (this process) drafts: its router proposes, and the step plan carries the
    drafts to the other ranks as n-gram's do. The head is small and not sharded; the target's layer outputs it
    reads are whole on every rank (aux_hidden.py), so rank 0's own are complete. Rank 0's embedding is only its
    vocabulary block (whose lookup all-reduces: a collective rank 0 must not call alone), so a head without an
    embedding of its own gets a whole copy read from the target's checkpoint: no collective, no other rank."""
    spec = config.speculative
    if spec is None or spec.draft_model is None:
        return None
    from tgi_compat.modeling.models.decoder import DecoderStack
    from tgi_compat.modeling.models.eagle3 import load_eagle3_head
    from tgi_compat.modeling.models.eagle3_config import has_own_embedding
    from tgi_compat.modeling.source import resolve_model_source
    from tgi_compat.modeling.weights.loader import read_tensor
    from tgi_compat.router.speculative.eagle3 import Eagle3Drafter

    assert runner.aux_hidden is not None and isinstance(runner.model, DecoderStack)  # (load_runner asked for them)
    embedding: torch.Tensor | None = runner.model.model.embed_tokens.weight
    if runner.tp.is_sharded:
        embedding = None
        if not has_own_embedding(resolve_model_source(spec.draft_model).folder):
            assert runner.source is not None  # (a served runner loads from its model id)
            name = "model.embed_tokens.weight"
            embedding = read_tensor(runner.source, runner.model_config, name, config.load_format, runner.device)
    head = load_eagle3_head(spec.draft_model, runner.vocab_size, embedding, runner.device, runner.dtype)
    logger.info("EAGLE-3 head %s reads target layers %s", spec.draft_model, runner.aux_hidden.layers)
    return Eagle3Drafter(head, runner.aux_hidden.rows, measure_head_cost(head))


def measure_head_cost(head: Eagle3Head) -> HeadCost:
    """The head's drafting time, measured beside the step-cost table (a few small batches on the CPU)."""
    from tgi_compat.modeling.step_cost import HEAD_COST_BATCHES, HEAD_COST_BATCHES_CPU, measure_head_costs

    on_gpu = head.fc.weight.device.type == "cuda"
    batches, fixed, per_draft = measure_head_costs(head, HEAD_COST_BATCHES if on_gpu else HEAD_COST_BATCHES_CPU)
    logger.info(
        "EAGLE-3 head cost (batch: fixed + ms per draft): %s",
        ", ".join(f"{b}: {1e3 * f:.2f} + {1e3 * d:.2f}" for b, f, d in zip(batches, fixed, per_draft)),
    )
    return HeadCost(StepCostTable(batches, fixed), StepCostTable(batches, per_draft))


def fit_to_runner(config: EngineConfig, runner: ModelRunner) -> EngineConfig:
    """The config as the loaded runner refines it (speculation's step-cost table and verify graphs)."""
    if config.speculative is None:
        return config
    return dataclasses.replace(config, speculative=tune_speculation(config.speculative, runner))


def tune_speculation(config: SpeculativeConfig, runner: ModelRunner) -> SpeculativeConfig:
    """What speculation learns of the loaded runner: the batch up to which drafts are padded to one length (its
    verify graphs), and, on a GPU without a table in the config, the measured step-cost table (which turns
    drafts off where a step's extra rows cost more than they bring: large batches)."""
    from tgi_compat.modeling.step_cost import measure_step_costs

    step_cost = config.step_cost
    # (tensor-parallel ranks follow rank 0's steps only once serving: a sharded engine takes a configured table)
    if step_cost is None and runner.device.type == "cuda" and not runner.tp.is_sharded:
        rows, seconds = measure_step_costs(runner)
        step_cost = StepCostTable(rows, seconds)
        logger.info("step cost (rows: ms): %s", ", ".join(f"{r}: {1e3 * s:.2f}" for r, s in zip(rows, seconds)))
    return dataclasses.replace(config, step_cost=step_cost, uniform_max_batch=runner.verify_graph_max_batch)
