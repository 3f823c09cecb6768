"""The device's step time against token rows, measured once at startup after the CUDA-graph capture: what
the speculative draft-length policy weighs drafts against (tgi_compat/router/speculative/policy.py).

A step of n rows is timed as the runner would run it: n one-token requests (a replayed decode graph where
one holds n); past the largest decode graph, n / q requests of q tokens where a verify graph holds that
(what a verify step of that many rows replays), else one request of n new tokens (an eager step). Every row
belongs to the reserved padding row and writes the reserved KV slot, so no live request is touched (the
engine measures before it serves anything).

An EAGLE-3 head's time is measured beside it (`measure_head_costs`, on the CPU too: a few small batches): for B
requests, one forward folding each request's newest target hidden state in (its fixed cost per drafting step) and
one forward per draft token, each over a cache of HEAD_COST_CONTEXT rows, as the proposer runs them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch, build_forward_batch
from tgi_compat.modeling.runner import ModelRunner

if TYPE_CHECKING:  # (the head's module imports kernels: loaded only with a head)
    from tgi_compat.modeling.models.eagle3 import Eagle3Head

STEP_COST_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
HEAD_COST_BATCHES = (1, 4, 16, 64, 256)
HEAD_COST_BATCHES_CPU = (1, 4)  # (cheap: a CPU engine measures at every start)
HEAD_COST_CONTEXT = 512  # cached rows per request while drafting (the head's attention grows with them)


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
        seconds.append(_median_seconds(runner.device, partial(runner.forward, batch), repeats))
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


@torch.inference_mode()
def measure_head_costs(
    head: Eagle3Head, batches: tuple[int, ...], context: int = HEAD_COST_CONTEXT, repeats: int = 5
) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
    """(batch sizes, median seconds of the fold forward, of one draft forward) of the head at each batch size."""
    device = head.fc.weight.device
    fixed, per_draft = [], []
    for b in batches:
        fold, draft = _head_forwards(head, b, context)
        fixed.append(_median_seconds(device, fold, repeats))
        per_draft.append(_median_seconds(device, draft, repeats))
    return batches, tuple(fixed), tuple(per_draft)


def _head_forwards(head: Eagle3Head, b: int, context: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """The head's fold forward and draft forward for b requests of `context` cached rows (zeros: the time of a
    forward does not depend on the values)."""
    from tgi_compat.modeling.models.eagle3 import BatchedKV, DraftKV

    device, dtype = head.fc.weight.device, head.fc.weight.dtype
    attn, context = head.layer.self_attn, min(context, head.cos.shape[0] - 1)  # (positions the head has rotary for)
    kv = torch.zeros(context, attn.num_kv_heads, attn.head_dim, device=device, dtype=dtype)
    cache = BatchedKV.of([DraftKV(kv, kv)] * b)
    ids = torch.zeros(b, 1, dtype=torch.int64, device=device)
    positions, one = torch.full_like(ids, context), torch.ones(b, dtype=torch.int64, device=device)
    target = torch.zeros(b, 1, 3 * head.config.target_hidden_size, device=device, dtype=dtype)
    own = torch.zeros(b, 1, head.config.hidden_size, device=device, dtype=dtype)

    def fold() -> None:
        logits = head(ids, positions, target, cache, one, from_target=True)[0]
        head.to_target_ids(logits[:, -1].argmax(-1)).tolist()  # (the proposer's one host copy)

    def draft() -> None:
        logits, _, k, v = head(ids, positions, own, cache, one, from_target=False)
        head.to_target_ids(logits[:, 0].argmax(-1))
        cache.appended(k, v)  # (the proposer's cache grows by a row per draft)

    return fold, draft


def _median_seconds(device: torch.device, run: Callable[[], object], repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):  # compile and warm
        run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
