"""The one-shot all-reduce kernel under Triton's interpreter, each rank in its own process.

Shared CPU memory stands in for symmetric GPU memory: every rank maps the same buffers and flags and gives the
kernel the addresses it sees them at, as symmetric memory gives each rank its peers' addresses. The ranks make
a sequence of sums of different sizes (one to three programs, so the programs' sum counts diverge and both
halves of the buffer are reused) and must all agree with the reference: fp32 exactly; bf16 to one unit in the
last place, because the interpreter rounds fp32 -> bf16 towards zero where the GPU rounds to nearest, and with
the same bits on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from kernels.one_shot_all_reduce import BLOCK, MAX_PROGRAMS, SUMS_MODULUS_MASK, all_reduce_ref

SIZES = (1000, 2 * BLOCK + 1, 300, BLOCK, 7, 2 * BLOCK + 1, 1000)
CAPACITY = 3 * BLOCK


def _rank(rank: int, buffers, flags, inputs, results, sums_before: int) -> None:
    from kernels.one_shot_all_reduce import one_shot_all_reduce_

    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    sums_made = torch.full((MAX_PROGRAMS,), sums_before, dtype=torch.int32)
    offset = 0
    for x in inputs[rank]:
        y = x.clone()
        assert one_shot_all_reduce_(y, buffer_ptrs, flag_ptrs, sums_made, CAPACITY, rank) is y
        results[rank][offset : offset + y.numel()] = y.float()
        offset += y.numel()
    results[rank][-4:] = sums_made[:4].double()


@pytest.mark.parametrize(
    ("world", "dtype", "sums_before"),
    [
        (2, torch.float32, 0),
        (2, torch.bfloat16, 0),
        (3, torch.float32, 0),
        (2, torch.float32, SUMS_MODULUS_MASK - 2),  # the sum counters wrap to 0 on the way
    ],
)
def test_ranks_agree_with_reference(
    world: int, dtype: torch.dtype, sums_before: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import the kernel interpreted
    buffers = [torch.zeros(2 * CAPACITY, dtype=dtype).share_memory_() for _ in range(world)]
    flags = [torch.zeros(2 * MAX_PROGRAMS * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    generator = torch.Generator().manual_seed(world)
    inputs = [[torch.randn(n, generator=generator).to(dtype) for n in SIZES] for _ in range(world)]
    # float64: holds the sums (float32 or bf16) and the programs' sum counters (up to 2^30) exactly
    results = [torch.full((sum(SIZES) + 4,), float("nan"), dtype=torch.float64).share_memory_() for _ in range(world)]

    context = mp.get_context("spawn")
    ranks = [
        context.Process(target=_rank, args=(r, buffers, flags, inputs, results, sums_before)) for r in range(world)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0] * world

    expected = torch.cat([all_reduce_ref([inputs[r][i] for r in range(world)]).double() for i in range(len(SIZES))])
    for r in range(world):
        assert torch.equal(results[r], results[0])  # the same bits on every rank
    got = results[0][:-4]
    if dtype == torch.float32:
        assert torch.equal(got, expected)
    else:
        ulp = torch.finfo(dtype).eps * expected.abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((got - expected).abs() <= ulp).all()
    # program 0 made every sum, programs 1 and 2 the two of 2 * BLOCK + 1 elements (counted modulo 2^30)
    made = [len(SIZES), 2, 2, 0]
    assert results[0][-4:].tolist() == [float((sums_before + n) & SUMS_MODULUS_MASK) for n in made]
