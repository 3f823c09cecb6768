"""The one-shot all-reduce kernel under Triton's interpreter, each rank in its own process.

Shared CPU memory stands in for symmetric GPU memory: every rank maps the same buffers and gives the kernel the
addresses it sees them at, as symmetric memory gives each rank its peers' addresses. The ranks make a sequence
of sums of different sizes (one to three programs, so the programs' halves diverge and both halves of the
buffer are reused), with -0.0 among the inputs (the sentinel's bits), and must all agree with the reference to
one unit in the last place (the interpreter rounds fp32 -> bf16/fp16 towards zero where the GPU rounds to
nearest), with the same bits on every rank; afterwards every buffer holds only the sentinel again.

In the ranks the interpreter moves each element with one access of its width (`_WholeElements`), as the GPU
does: its own loads and stores could let a rank see half of a peer's store.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tgi_compat.kernels.comm.one_shot_all_reduce import BLOCK, MAX_PROGRAMS, SENTINEL, all_reduce_ref

SIZES = (1000, 2 * BLOCK + 1, 300, BLOCK, 7, 2 * BLOCK + 1, 1000)
CAPACITY = 3 * BLOCK


def run_ranks(target, world: int, *args) -> None:
    """target(rank, *args) in a spawned process per rank, all at once, with whole-element loads and stores
    (`_WholeElements`); each must exit 0."""
    context = mp.get_context("spawn")
    ranks = [context.Process(target=_rank_process, args=(target, r, *args)) for r in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    for process in ranks:  # a rank that waits for a sum that never comes must not outlive the test
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in ranks] == [0] * world


def _rank_process(target, rank: int, *args) -> None:
    """A rank: target(rank, *args) with the interpreter's loads and stores `_WholeElements`'."""
    from triton.runtime import interpreter

    interpreter._interpreter = _WholeElements(interpreter._interpreter)
    target(rank, *args)


class _WholeElements:
    """Triton's interpreter core (triton._C.libtriton.interpreter) with a load and a store that move each element
    with one access of its width, as the GPU does: the core's own split a 16-bit element in two.

    The core moves each element with memcpy(dst, src, itemsize), and glibc's memcpy of 2 bytes (2.36, x86-64)
    reads byte 0, then both bytes, and writes both bytes, then byte 0 again. A rank polling its buffer could so
    read byte 0 of a slot before a peer's store and byte 1 after it: the sentinel's low byte under the value's
    high byte (0xbe00 for 0xbeeb), which is not the sentinel, so it was added as the peer's value and that rank's
    sum differed from the others' (test_all_reduce_with_residual_and_rmsnorm[4], now and then on the loaded
    2-core machine). The store's second write of byte 0 could likewise land on a sentinel just put back.
    On the GPU no element is split: each thread sends its elements to a peer with one 16-byte store and polls them
    with one 16-byte volatile load (test_kernel_one_shot_all_reduce_compiled.py), so an element is written and
    read by one instruction each, carried out in aligned 32-bit words at the least, and a poll sees it as it was
    before the store or as it is after. numpy's indexing moves an aligned element with one access of its width."""

    def __init__(self, core) -> None:
        self._core = core

    def __getattr__(self, name: str):
        return getattr(self._core, name)  # the rest (atomics, math) as the core has them

    def load(self, ptrs: np.ndarray, mask: np.ndarray, other: np.ndarray, dtype: np.dtype) -> np.ndarray:
        out = np.array(np.broadcast_to(other, ptrs.shape), dtype=dtype)
        mask = np.broadcast_to(mask, ptrs.shape)
        if mask.any():
            memory, index = _elements(ptrs[mask], dtype)
            out[mask] = memory[index]
        return out

    def store(self, ptrs: np.ndarray, value: np.ndarray, mask: np.ndarray) -> None:
        mask = np.broadcast_to(mask, ptrs.shape)
        if mask.any():
            memory, index = _elements(ptrs[mask], value.dtype)
            memory[index] = np.broadcast_to(value, ptrs.shape)[mask]


def _elements(ptrs: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The memory from the lowest to the highest of ptrs (addresses of dtype elements) as an aligned array of
    dtype, and the elements' indices in it."""
    low = ptrs.min()
    offsets = ptrs - low
    assert int(low) % dtype.itemsize == 0 and not (offsets % dtype.itemsize).any(), "unaligned elements"
    count = int(offsets.max()) // dtype.itemsize + 1
    return np.asarray(_Memory(int(low), count, dtype)), (offsets // dtype.itemsize).astype(np.intp)


class _Memory:
    """`count` elements of `dtype` at `address`, for np.asarray: an array over memory that numpy does not own."""

    def __init__(self, address: int, count: int, dtype: np.dtype) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (count,), "typestr": dtype.str, "version": 3}


def _rank(rank: int, buffers, inputs, results) -> None:
    from tgi_compat.kernels.comm.one_shot_all_reduce import one_shot_all_reduce_

    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    halves = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    offset = 0
    for x in inputs[rank]:
        y = x.clone()
        assert one_shot_all_reduce_(y, buffer_ptrs, halves, CAPACITY, rank) is y
        results[rank][offset : offset + y.numel()] = y.float()
        offset += y.numel()
    results[rank][-4:] = halves[:4].double()


@pytest.mark.parametrize(
    ("world", "dtype"), [(2, torch.bfloat16), (2, torch.float16), (3, torch.bfloat16), (4, torch.bfloat16)]
)
def test_ranks_agree_with_reference(world: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import the kernel interpreted
    buffers = [torch.full((2 * world * CAPACITY,), SENTINEL, dtype=torch.int16).share_memory_() for _ in range(world)]
    generator = torch.Generator().manual_seed(world)
    inputs = [[torch.randn(n, generator=generator).to(dtype) for n in SIZES] for _ in range(world)]
    for rank_inputs in inputs:  # -0.0 has the sentinel's bits: it must travel as a zero, not hang the sum
        rank_inputs[0][:5] = -0.0
    # float64: holds the sums and the programs' halves exactly
    results = [torch.full((sum(SIZES) + 4,), float("nan"), dtype=torch.float64).share_memory_() for _ in range(world)]

    run_ranks(_rank, world, buffers, inputs, results)

    expected = torch.cat([all_reduce_ref([inputs[r][i] for r in range(world)]).double() for i in range(len(SIZES))])
    for r in range(world):  # the same bits on every rank
        assert torch.equal(results[r], results[0]), _where_ranks_differ(results[r], results[0], r)
    got = results[0][:-4]
    ulp = torch.finfo(dtype).eps * expected.abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((got - expected).abs() <= ulp).all()
    assert (got[:5] == 0).all()
    # program 0 made every sum (7: it ends on half 1), programs 1 and 2 the two of 2 * BLOCK + 1 elements
    assert results[0][-4:].tolist() == [1.0, 0.0, 0.0, 0.0]
    for buffer in buffers:
        assert (buffer == SENTINEL).all()  # every sum put back the sentinel in what it read


def _where_ranks_differ(ours: torch.Tensor, rank0s: torch.Tensor, rank: int) -> str:
    """Which sums and elements differ between a rank's results and rank 0's."""
    differ = ((ours != rank0s) & ~(ours.isnan() & rank0s.isnan())).nonzero().flatten()
    starts = torch.tensor((0, *SIZES)).cumsum(0)
    sums = sorted({int(torch.searchsorted(starts, i, right=True)) - 1 for i in differ.tolist()})
    return (
        f"rank {rank}: {differ.numel()} elements differ from rank 0's (sums {sums}, first at {differ[:5].tolist()}: "
        f"{ours[differ[:5]].tolist()} vs {rank0s[differ[:5]].tolist()}); NaN {int(ours.isnan().sum())} vs "
        f"{int(rank0s.isnan().sum())}"
    )


GATHER_SHAPES = ((1, 3000), (3, 700), (2, BLOCK + 5))  # (rows, each rank's columns)


def _gathering_rank(rank: int, buffers, inputs, results) -> None:
    from tgi_compat.kernels.comm.one_shot_all_reduce import one_shot_all_gather, one_shot_all_reduce_

    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    halves = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    offset = 0
    for i, x in enumerate(inputs[rank]):
        if i == 1:  # a sum between the gathers: the two kinds share the buffers and the halves
            one_shot_all_reduce_(x.view(-1).clone(), buffer_ptrs, halves, CAPACITY, rank)
        gathered = one_shot_all_gather(x, buffer_ptrs, halves, CAPACITY, rank)
        results[rank][offset : offset + gathered.numel()] = gathered.view(-1).double()
        offset += gathered.numel()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_gather_puts_each_ranks_columns_in_place(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank ends with [rows, world * cols] holding rank r's x at columns r * cols (vocab-parallel logits),
    bit for bit but -0.0, which arrives as +0.0; the buffers hold only the sentinel afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    buffers = [torch.full((2 * world * CAPACITY,), SENTINEL, dtype=torch.int16).share_memory_() for _ in range(world)]
    generator = torch.Generator().manual_seed(10 + world)
    inputs = [[torch.randn(shape, generator=generator).bfloat16() for shape in GATHER_SHAPES] for _ in range(world)]
    for rank_inputs in inputs:
        rank_inputs[0][0, :3] = -0.0
    total = sum(rows * cols * world for rows, cols in GATHER_SHAPES)
    results = [torch.full((total,), float("nan"), dtype=torch.float64).share_memory_() for _ in range(world)]

    run_ranks(_gathering_rank, world, buffers, inputs, results)

    side_by_side = [torch.cat([inputs[r][i] for r in range(world)], dim=1) for i in range(len(GATHER_SHAPES))]
    expected = torch.cat([gathered.view(-1).double() for gathered in side_by_side])
    for r in range(world):
        assert torch.equal(results[r], expected)
    assert not torch.signbit(results[0][:3]).any()  # -0.0 came as +0.0
    for buffer in buffers:
        assert (buffer == SENTINEL).all()


NORM_SHAPES = ((1, 2 * BLOCK), (2, 2 * BLOCK), (3, BLOCK))  # (rows, hidden): rows of two pieces, rows of one
NORM_CAPACITY = 4 * BLOCK
EPS = 1e-5


def _norming_rank(rank: int, buffers, inputs, residuals, weights, results) -> None:
    from tgi_compat.kernels.comm.one_shot_all_reduce import one_shot_all_reduce_, one_shot_all_reduce_rmsnorm

    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    halves = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    offset = 0
    for i, x in enumerate(inputs[rank]):
        if i == 1:  # a plain sum between: the two kernels share the buffers and the pieces' halves
            one_shot_all_reduce_(x.view(-1)[:1000].clone(), buffer_ptrs, halves, NORM_CAPACITY, rank)
        residual = residuals[i].clone()
        normed, summed = one_shot_all_reduce_rmsnorm(
            x, residual, weights[i], EPS, buffer_ptrs, halves, NORM_CAPACITY, rank
        )
        assert torch.equal(residual, residuals[i])  # the caller's residual is left as it was
        for out in (normed, summed):
            results[rank][offset : offset + out.numel()] = out.view(-1).double()
            offset += out.numel()
    results[rank][-4:] = halves[:4].double()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_with_residual_and_rmsnorm(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank ends with the unfused ops' (rmsnorm(sum + residual) * w, sum + residual), the same bits on every
    rank (within the interpreter's rounding towards zero of the reference), the pieces' halves as the plain kernel
    would leave them, and only the sentinel in the buffers."""
    from tgi_compat.kernels.elementwise.rmsnorm import rmsnorm_ref

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    size = 2 * world * NORM_CAPACITY
    buffers = [torch.full((size,), SENTINEL, dtype=torch.int16).share_memory_() for _ in range(world)]
    generator = torch.Generator().manual_seed(20 + world)
    inputs = [[torch.randn(shape, generator=generator).bfloat16() for shape in NORM_SHAPES] for _ in range(world)]
    residuals = [torch.randn(shape, generator=generator).bfloat16() for shape in NORM_SHAPES]
    weights = [(1 + torch.randn(hidden, generator=generator) / 4).bfloat16() for _, hidden in NORM_SHAPES]
    total = sum(2 * rows * hidden for rows, hidden in NORM_SHAPES)
    results = [torch.full((total + 4,), float("nan"), dtype=torch.float64).share_memory_() for _ in range(world)]

    run_ranks(_norming_rank, world, buffers, inputs, residuals, weights, results)

    for r in range(world):
        assert torch.equal(results[r], results[0])
    offset = 0
    for i, (rows, hidden) in enumerate(NORM_SHAPES):
        summed = residuals[i].clone()
        normed = rmsnorm_ref(all_reduce_ref([inputs[r][i] for r in range(world)]), weights[i], EPS, residual=summed)
        got_normed = results[0][offset : offset + rows * hidden].view(rows, hidden)
        got_summed = results[0][offset + rows * hidden : offset + 2 * rows * hidden].view(rows, hidden)
        offset += 2 * rows * hidden
        # the interpreter rounds towards zero where the GPU rounds to nearest: a unit in the last place of each
        # rounding (the sum, the add, the norm, the scale)
        torch.testing.assert_close(got_summed, summed.double(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got_normed, normed.double(), rtol=4e-2, atol=4e-2)
    # piece 0 made all four operations (ends on half 0), piece 1 three, pieces 2 and 3 two and one
    assert results[0][-4:].tolist() == [0.0, 1.0, 0.0, 1.0]
    for buffer in buffers:
        assert (buffer == SENTINEL).all()
