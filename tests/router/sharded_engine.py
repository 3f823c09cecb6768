"""A generating engine over `config.num_shard` tensor-parallel ranks, for tests and GPU checks: rank 0's EngineCore in
this process, the other ranks the server's own worker (tgi_compat.router.tp_worker), spawned. gloo on the CPU, NCCL
on GPUs (rank r on cuda:r)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import cast

import torch

from tests.router.router_fakes import drain
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest, SamplingParams


@contextmanager
def sharded_engine(config: EngineConfig) -> Iterator[EngineCore]:
    """The engine of `config` (its master_port free: tests.benchmarks.conftest.free_port), the other ranks running
    until it closes; one rank: a plain engine."""
    from tgi_compat.modeling.parallel.group import destroy_tensor_parallel
    from tgi_compat.modeling.runner import ModelRunner
    from tgi_compat.router.rank_heartbeat import RankHeartbeats
    from tgi_compat.router.tp_worker import run_tp_worker

    heartbeats, spawn = RankHeartbeats(config.num_shard), multiprocessing.get_context("spawn")
    workers = [
        spawn.Process(target=run_tp_worker, args=(config, rank, os.getpid(), heartbeats), daemon=True)
        for rank in range(1, config.num_shard)
    ]
    for worker in workers:
        worker.start()
    threads, engine = torch.get_num_threads(), None
    try:
        engine = EngineCore.from_config(config)
        yield engine
    finally:
        if engine is not None:
            engine.close()  # (releases the other ranks)
            runner = cast(ModelRunner, engine.executor.runner)
            if runner.device.type == "cpu":  # (NCCL's teardown may block: a GPU caller exits its process instead)
                destroy_tensor_parallel(runner.tp)
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
        torch.set_num_threads(threads)  # (a sharded CPU runner shares the cores out)
    assert all(worker.exitcode == 0 for worker in workers), [worker.exitcode for worker in workers]


def generate(
    engine: EngineCore, prompts: Mapping[int, Sequence[int]], sampling: SamplingParams, max_new_tokens: int
) -> dict[str, list[int]]:
    """Request "r{i}" of each prompt, run together to the end (ignoring EOS) -> each one's token ids; the KV pool is
    full again after (router_fakes.drain)."""
    for i, prompt in prompts.items():
        params = SamplingParams(**{name: getattr(sampling, name) for name in SamplingParams.__slots__})
        engine.add_request(GenerateRequest(f"r{i}", list(prompt), params, max_new_tokens, ignore_eos=True))
    events = drain(engine)
    return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}
