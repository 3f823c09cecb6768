"""The GEMV that sends its output to the other ranks' all-reduce buffers (tgi_compat.kernels.gemv.gemv's `push`), then the
all-reduce that only gathers (`sent=True`), under Triton's interpreter with each rank in its own process.

Shared CPU memory stands in for symmetric GPU memory, as in test_kernel_one_shot_all_reduce.py. Each rank
runs a sequence of row-parallel products: pushed ones (one row of a plain weight, three rows of an int8
row-scaled one) between plain all-reduces of other sizes on the same buffers, so the pushed sums must pick the
buffer halves the all-reduce's programs use. Every pushed sum must have the same bits as the unfused pair (the
GEMV, then the all-reduce, run right after it on the same ranks), on every rank; both equal the reference to one
unit in the last place (the interpreter rounds fp32 -> bf16/fp16 towards zero where torch rounds to nearest);
and the buffers must hold only the sentinel after.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernel_one_shot_all_reduce import run_ranks
from tgi_compat.kernels.comm.one_shot_all_reduce import BLOCK, MAX_PROGRAMS, SENTINEL, PushTarget, all_reduce_ref
from tgi_compat.kernels.gemv.gemv import gemv
from tgi_compat.kernels.gemv.types import QuantizedWeight

CAPACITY = 3 * BLOCK
K = 32
# (rows, N, pushed): 3 x 683 = BLOCK + 1 outputs take two all-reduce programs, the second with one element
STEPS = ((1, 300, True), (1, 100, False), (3, (BLOCK + 1) // 3, True), (1, 5, False), (1, 300, True))


def _weights(rank: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor | QuantizedWeight]]:
    gen = torch.Generator().manual_seed(rank)
    out = []
    for rows, n, _ in STEPS:
        x = torch.randn(rows, K, generator=gen).to(dtype)
        if rows == 1:
            weight: torch.Tensor | QuantizedWeight = (torch.randn(n, K, generator=gen) / 8).to(dtype)
        else:  # several rows: the GEMV takes them with a row-scaled weight only
            q = torch.randint(-128, 128, (n, K), generator=gen, dtype=torch.int8)
            weight = QuantizedWeight(q, torch.rand(n, generator=gen) / 100)
        out.append((x, weight))
    return out


def _rank(rank: int, world: int, buffers, results, dtype: torch.dtype) -> None:
    from tgi_compat.kernels.comm.one_shot_all_reduce import one_shot_all_reduce_

    target = PushTarget(
        torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
        torch.zeros(MAX_PROGRAMS, dtype=torch.int32),
        CAPACITY,
        rank,
    )
    offset = 0
    for (x, weight), (_, _, pushed) in zip(_weights(rank, dtype), STEPS, strict=True):
        unfused = one_shot_all_reduce_(gemv(x, weight), target.buffer_ptrs, target.halves, CAPACITY, rank)
        if pushed:
            out = gemv(x, weight, push=target)
            one_shot_all_reduce_(out, target.buffer_ptrs, target.halves, CAPACITY, rank, sent=True)
            assert torch.equal(out, unfused), (rank, out.shape)
        results[rank][offset : offset + unfused.numel()] = unfused.flatten().float()
        offset += unfused.numel()


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.bfloat16), (3, torch.float16)])
def test_pushed_gemv_sums_equal_the_unfused_pair(world: int, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import the kernels interpreted
    buffers = [torch.full((2 * world * CAPACITY,), SENTINEL, dtype=torch.int16).share_memory_() for _ in range(world)]
    total = sum(rows * n for rows, n, _ in STEPS)
    results = [torch.full((total,), float("nan"), dtype=torch.float64).share_memory_() for _ in range(world)]

    run_ranks(_rank, world, world, buffers, results, dtype)

    # the unfused pair's sum: each rank's GEMV output (rounded to dtype), added in fp32 in rank order
    weights = [_weights(r, dtype) for r in range(world)]
    expected = torch.cat(
        [all_reduce_ref([gemv(*weights[r][i]) for r in range(world)]).flatten().double() for i in range(len(STEPS))]
    )
    for r in range(world):
        assert torch.equal(results[r], results[0])  # the same bits on every rank
    ulp = torch.finfo(dtype).eps * expected.abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((results[0] - expected).abs() <= ulp).all()
    for buffer in buffers:
        assert (buffer == SENTINEL).all()
