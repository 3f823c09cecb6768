"""The device's step time against token rows, measured once at startup after the CUDA-graph capture: what
the speculative draft-length policy weighs drafts against (tgi_compat/router/speculative/policy.py).

A step of n rows is timed as the runner would run it: n one-token requests (a replayed decode graph where
one holds n); past the largest decode graph, n / q requests of q tokens where a verify graph holds that
(what a verify step of that many rows replays), else one request of n new tokens (an eager step). Every row
belongs to the reserved padding row and writes the reserved KV slot, so no live request is touched (the
engine measures before it serves anything).
"""

from __future__ import annotations

import statistics
import time

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch, build_forward_batch
from tgi_compat.modeling.runner import ModelRunner

STEP_COST_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def measure_step_costs(
    runner: ModelRunner, rows: tuple[int, ...] = STEP_COST_ROWS, repeats: int = 5
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(row counts, median seconds of a step of that many rows) for the counts the runner can hold."""
    graphs = runner.cuda_graphs
    max_decode = graphs.max_batch_size if graphs is not None else runner.max_rows
    measured, seconds = [], []
    for num_rows in rows:
        if num_rows > max_decode and num_rows > runner.max_seq_len:
            break
        batch = _step_batch(runner, num_rows, num_rows <= max_decode)
        measured.append(num_rows)
        seconds.append(_median_seconds(runner, batch, repeats))
    return tuple(measured), tuple(seconds)


def _step_batch(runner: ModelRunner, num_rows: int, as_decode: bool) -> ForwardBatch:
    tokens_per_request = num_rows  # one request of n new tokens (eager)
    if as_decode:  # n decoding requests, one token of context each
        tokens_per_request = 1
    else:
        for q, graphs in sorted(runner.verify_graphs.items()):
            if num_rows % q == 0 and num_rows // q <= graphs.max_batch_size:
                tokens_per_request = q
                break
    num_requests = num_rows // tokens_per_request
    return build_forward_batch(  # the runner's reserved row and slot
        input_ids=[0] * num_rows,
        req_rows=[runner.max_rows] * num_requests,
        q_lens=[tokens_per_request] * num_requests,
        kv_lens=[tokens_per_request] * num_requests,
        out_slots=[runner.num_kv_slots] * num_rows,
        logits_indices=list(range(num_rows)),
        device=runner.device,
    )


def _median_seconds(runner: ModelRunner, batch: ForwardBatch, repeats: int) -> float:
    def sync() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)

    for _ in range(2):  # compile and warm
        runner.forward(batch)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(batch)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
