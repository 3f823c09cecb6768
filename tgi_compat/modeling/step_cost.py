"""The device's step time against token rows, measured once at startup after the CUDA-graph capture: what
the speculative draft-length policy weighs drafts against (tgi_compat/router/speculative/policy.py).

A step of n rows is timed as the runner would run it: n one-token requests (a replayed decode graph where
one holds n), or past the largest decode graph one request of n new tokens (an eager step). Every row
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
        as_decode = num_rows <= max_decode
        if not as_decode and num_rows > runner.max_seq_len:
            break
        batch = _step_batch(runner, num_rows, as_decode)
        measured.append(num_rows)
        seconds.append(_median_seconds(runner, batch, repeats))
    return tuple(measured), tuple(seconds)


def _step_batch(runner: ModelRunner, num_rows: int, as_decode: bool) -> ForwardBatch:
    pad_row, pad_slot = runner.max_rows, runner.num_kv_slots  # the runner's reserved row and slot
    if as_decode:  # n decoding requests, one token of context each
        return build_forward_batch(
            input_ids=[0] * num_rows,
            req_rows=[pad_row] * num_rows,
            q_lens=[1] * num_rows,
            kv_lens=[1] * num_rows,
            out_slots=[pad_slot] * num_rows,
            logits_indices=list(range(num_rows)),
            device=runner.device,
        )
    return build_forward_batch(  # one request of n new tokens
        input_ids=[0] * num_rows,
        req_rows=[pad_row],
        q_lens=[num_rows],
        kv_lens=[num_rows],
        out_slots=[pad_slot] * num_rows,
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
