"""Kernels that every decode step runs compile once, whatever the step's batch size (marker `gpu`; skipped without
CUDA). Triton specialises an int argument on being 1 or a multiple of 16 and a pointer on 16-byte alignment: a batch
of a new kind compiled the greedy choice (0.26-1 s) and the KV store (181 ms) in the middle of serving, a stall of
every stream (session 27, TGI_STALL_TRACE_MS). The sizes here cover 1, multiples of 16 and neither, odd and even.

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_compile_once_gpu.py
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tgi_compat.kernels.attention.kv_store import _kv_store_kernel, kv_store
from tgi_compat.kernels.sampling.greedy_pick import _chunk_kernel, _merge_kernel, greedy_pick
from tgi_compat.router.batch import upload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BATCHES = (1, 7, 16, 63, 64, 65)


def compiled_variants(kernel) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def new_variants(kernels, run) -> int:
    """The variants of `kernels` that `run()` compiled (other tests in the same process may have compiled others, for
    other dtypes or shapes, before: session 28 ran this file after the LoRA and VLM tests)."""
    before = sum(map(compiled_variants, kernels))
    run()
    return sum(map(compiled_variants, kernels)) - before


def test_the_greedy_choice_compiles_once_for_every_batch_size():
    def pick(rows: int) -> None:
        logits = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
        ids, _ = greedy_pick(logits)
        torch.testing.assert_close(ids, logits.float().argmax(-1))

    pick(BATCHES[0])  # (compiles it, unless an earlier test did)
    for rows in BATCHES[1:]:
        assert new_variants((_chunk_kernel, _merge_kernel), partial(pick, rows)) == 0, rows


def test_the_kv_store_compiles_once_for_slots_of_every_packed_step():
    """A decode step's out_slots are row 1 of its packed upload (tgi_compat.router.batch.upload)."""
    k_cache = torch.zeros(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)

    def store(rows: int) -> None:
        slots = list(range(rows * 3, rows * 4))
        packed = upload([list(range(rows)), slots, [0] * rows], torch.device("cuda"))
        k = torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_store(k, v, k_cache, v_cache, packed[1])
        torch.testing.assert_close(k_cache[slots], k)

    store(BATCHES[0])
    for rows in BATCHES[1:]:
        assert new_variants((_kv_store_kernel,), partial(store, rows)) == 0, rows
