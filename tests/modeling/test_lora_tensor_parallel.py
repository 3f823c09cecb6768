"""LoRA under tensor parallelism on CPU (gloo): 2 ranks of the embedded SmolLM2 (q|k|v and gate|up cut by output,
o and down by input) run test_lora_parity's batch of base and adapter rows, greedily, and give TP=1's tokens,
logprobs and prefill logits.

The ranks start as the server starts them (tgi_compat.router.model_loading.load_runner): rank 0 loads the adapters
through the engine's LoraRegistry, which numbers them, after the runners are up (as a load while serving does) and
sends each to rank 1 (StepBroadcast's adapter messages), which reads its own cut in a thread; each step's slots and
slot loads travel with the step, so rank 1 copies its cut of each adapter into the same slot. Rank 0 then unloads
them, which rank 1 follows too.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.lora_adapters import write_smollm2_adapter
from tests.modeling.helpers import max_rel_error
from tests.modeling.test_lora_parity import RANKS, _run_mixed_batch
from tests.modeling.test_tensor_parallel_logits import SMOLLM2, TOLERANCE
from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
from tgi_compat.modeling.runner import ModelRunner
from tgi_compat.router.config import EngineConfig, LoraSource
from tgi_compat.router.lora_registry import LoraRegistry
from tgi_compat.router.model_loading import load_runner
from tgi_compat.router.process_exit import exit_process


def _config(adapters: list[LoraSource], num_shard: int, port: int = 0) -> EngineConfig:
    return EngineConfig(
        model_id=SMOLLM2, device="cpu", dtype="float32", max_batch_total_tokens=1024, max_running_requests=8,
        num_shard=num_shard, master_addr="127.0.0.1", master_port=port,
        max_loras=4, max_cpu_loras=4, max_lora_rank=max(RANKS.values()), lora_adapters=adapters,
    )  # fmt: skip


def _with_startup_adapters(config: EngineConfig, rank: int) -> ModelRunner:
    """A rank's runner; on rank 0 the adapters loaded as EngineCore loads them (its registry numbers them, and
    rank 0 sends each to the other ranks)."""
    runner = load_runner(config, rank)
    assert runner.lora is not None
    if rank == 0:
        registry = LoraRegistry(runner.lora, config.max_cpu_loras, in_use=lambda _: False)
        for adapter in config.lora_adapters:
            registry.load(adapter.name, adapter.source)
    return runner


def _rank_main(rank: int, config: EngineConfig, results_path: str) -> None:
    runner = _with_startup_adapters(config, rank)
    if rank == 0:
        torch.save(_run_mixed_batch(runner), results_path)
        assert runner.lora is not None
        for adapter_id in list(runner.lora.adapters):
            runner.lora.remove(adapter_id)  # rank 1 drops its cut too
        runner.close()  # sends stop
    else:
        runner.follow_rank_zero(StepBroadcast(runner.tp))
    exit_process(0)  # as a served rank leaves (tests.modeling.tp_group)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[LoraSource]:
    root = tmp_path_factory.mktemp("lora-tp")
    return [
        LoraSource(name, str(write_smollm2_adapter(root / name, rank, seed=i)))
        for i, (name, rank) in enumerate(RANKS.items())
    ]


def test_two_ranks_give_one_ranks_tokens_logprobs_and_logits(adapters, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results_path = str(tmp_path / "tp2.pt")
    mp.start_processes(_rank_main, args=(_config(adapters, 2, port), results_path), nprocs=2, start_method="spawn")
    tokens, logprobs, prefill = torch.load(results_path)
    ref_tokens, ref_logprobs, ref_prefill = _run_mixed_batch(_with_startup_adapters(_config(adapters, 1), 0))
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0, atol=1e-4)
    assert max_rel_error(prefill, ref_prefill) <= TOLERANCE
    assert tokens[3] != tokens[0]  # the adapters matter: base and adapter-3 rows share their prompt, not their answer
