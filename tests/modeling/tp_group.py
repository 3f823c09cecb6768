"""One CPU tensor-parallel group (gloo, ranks spawned by torch.multiprocessing) that serves several models in turn,
for the modeling tests that hold sharded logits against one rank's: starting the processes, not the tiny models,
is what costs time. Rank 0 drives each model's steps through ModelRunner.forward, which broadcasts every batch
(StepBroadcast); the other ranks follow it (ModelRunner.follow_rank_zero)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from tests.benchmarks.conftest import free_port
from tgi_compat.modeling.parallel import TensorParallel, init_tensor_parallel
from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
from tgi_compat.modeling.runner import ModelRunner
from tgi_compat.router.process_exit import exit_process

# key -> (the model's folder or id, rank 0's steps over its runner: what each returns is kept under the key)
Runs = dict[str, tuple[str, Callable[[ModelRunner], list[torch.Tensor]]]]


def serve_in_turn(
    rank: int,
    size: int,
    port: int,
    runs: Runs,
    make_runner: Callable[[str, TensorParallel], ModelRunner],
    results_path: str,
    images: bool = False,  # the steps carry image rows: the broadcast sizes their buffer by the hidden size
) -> None:
    """One rank's life (a spawn target: its arguments must pickle); rank 0 saves {key: its steps' results}."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, "127.0.0.1", port, torch.device("cpu"))
    results = {}
    for key, (folder, steps_of) in runs.items():
        runner = make_runner(folder, tp)
        hidden_size = runner.model_config.hidden_size if images else 0
        steps = StepBroadcast(tp, capacity=8, hidden_size=hidden_size)  # small: the first step makes both grow it
        if rank == 0:
            runner.step_sender = steps
            results[key] = steps_of(runner)
            steps.send_stop()
        else:
            runner.follow_rank_zero(steps)
    if rank == 0:
        torch.save(results, results_path)
    # As a served rank leaves (tp_worker): by exiting, without destroy_process_group and the interpreter's
    # teardown, where a rank once died of SIGABRT ("terminate called without an active exception") in CI.
    exit_process(0)


def saved_models(tmp_path_factory, models: dict[str, Callable[[str, dict], None]], sizes: dict, tag: str) -> dict:
    """name -> the folder its writer (folder, sizes) saved its tiny checkpoint into."""
    saved = {}
    for name, save in models.items():
        saved[name] = str(tmp_path_factory.mktemp(f"{tag}-{name}"))
        save(saved[name], sizes)
    return saved


def sharded_results(size: int, runs: Runs, make_runner, results_path: str, images: bool = False) -> dict:
    """Spawns a group of `size` ranks that serves `runs` in turn; rank 0's results by key."""
    args = (size, free_port(), runs, make_runner, results_path, images)
    mp.start_processes(serve_in_turn, args=args, nprocs=size, start_method="spawn")
    return torch.load(results_path)
