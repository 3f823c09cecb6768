"""Qwen2.5-VL under tensor parallelism on CPU (gloo, 2 ranks): rank 0 sends each step's image rows (with their
bidirectional spans, empty here) and M-RoPE positions through StepBroadcast; the sharded logits of a prefill with
two images, a chunk over its cached prefix and a decode step past the prompt equal one rank's."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from tests.modeling.helpers import max_rel_error
from tests.modeling.qwen2_5_vl_helpers import image_processor, tiny_qwen2_5_vl
from tests.modeling.test_qwen2_5_vl import VOCAB, grids, processed, prompt, run, text
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, init_tensor_parallel
from tgi_compat.modeling.parallel.group import destroy_tensor_parallel
from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.router.mrope import prompt_mrope


def _runner(folder: str, tp: TensorParallel) -> ModelRunner:
    config = RunnerConfig(model_id=folder, device="cpu", dtype="float32", num_kv_slots=128, max_rows=4)
    config.show_progress = False
    return ModelRunner(config, tp=tp)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    inputs = processed(2)
    ids, images = prompt(grids(inputs), text(1, 4), text(2, 3), text(3, 3))
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None
    features = runner.model.encode_processed(dict(inputs))
    full = ids + [17]
    slots = list(range(len(full)))
    cut = images[-1].offset + 2  # the second chunk starts inside the last image
    return [
        run(runner, full[:cut], 0, slots, features, mrope).clone(),
        run(runner, ids, cut, slots, features, mrope).clone(),
        run(runner, full, len(ids), slots, features, mrope).clone(),  # a decode: position + rope delta
    ]


def _rank_main(rank: int, size: int, port: int, folder: str, results_path: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, "127.0.0.1", port, torch.device("cpu"))
    runner = _runner(folder, tp)
    steps = StepBroadcast(tp, capacity=8, hidden_size=runner.model_config.hidden_size)
    if rank == 0:
        runner.step_sender = steps
        torch.save(_steps(runner), results_path)
        steps.send_stop()
    else:
        runner.follow_rank_zero(steps)
    destroy_tensor_parallel(tp)


def test_sharded_logits_with_images_equal_one_rank(tmp_path):
    tiny_qwen2_5_vl(VOCAB).save_pretrained(tmp_path)
    image_processor().save_pretrained(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results_path = str(tmp_path / "logits.pt")
    mp.start_processes(_rank_main, args=(2, port, str(tmp_path), results_path), nprocs=2, start_method="spawn")
    sharded = torch.load(results_path)
    for ours, one in zip(sharded, _steps(_runner(str(tmp_path), NO_TP))):
        assert max_rel_error(ours, one) <= 1e-4
