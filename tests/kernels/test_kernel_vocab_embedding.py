"""tgi_compat.kernels.comm.vocab_embedding under Triton's interpreter: the vocab-parallel lookup of one rank's block against
torch's, and the pushed lookup's sum over the ranks (each rank in its own process, shared CPU memory standing in
for symmetric GPU memory, as in test_kernel_gemv_push.py) against the whole table's rows, bit for bit: every row
comes from one rank and the others add zeros. Each pushed sum follows the plain all-reduce of the same lookup on
the same buffers, in steps of different sizes, so it must pick the buffer halves the all-reduce's programs use;
the buffers hold only the sentinel after."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernel_one_shot_all_reduce import run_ranks
from tgi_compat.kernels.comm.one_shot_all_reduce import BLOCK, MAX_PROGRAMS, SENTINEL, PushTarget
from tgi_compat.kernels.comm.vocab_embedding import vocab_shard_embedding, vocab_shard_embedding_ref

VOCAB = 50
HIDDENS = (3000, 2048)  # three lookup programs a row, the last partly masked; two whole ones (one half a program)
CAPACITY = 8 * BLOCK  # the largest step: 5 x 3000 elements
STEPS = (3, 1, 5)  # tokens a step; 3 and 5 tokens take several all-reduce programs, the last partly


def _table(dtype: torch.dtype, hidden: int = HIDDENS[0]) -> torch.Tensor:
    return torch.randn(VOCAB, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)


def _block(rank: int, world: int, dtype: torch.dtype, hidden: int = HIDDENS[0]) -> tuple[torch.Tensor, int, int]:
    """This rank's block of rows, zero-padded to the same length on every rank (as tgi_compat.modeling.parallel.vocab_shard)."""
    per_rank = -(-VOCAB // world)
    start = rank * per_rank
    size = max(0, min(VOCAB, start + per_rank) - start)
    block = torch.zeros(per_rank, hidden, dtype=dtype)
    block[:size] = _table(dtype, hidden)[start : start + size]
    return block, start, size


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS[step],), generator=torch.Generator().manual_seed(100 + step))


@pytest.mark.parametrize("world", [2, 3])
def test_lookup_matches_torch_and_the_blocks_sum_to_the_table(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ids = torch.arange(VOCAB - 1, -1, -1)  # every id, each rank's and none
    total = torch.zeros(VOCAB, HIDDENS[0], dtype=torch.float64)
    for rank in range(world):
        block, start, size = _block(rank, world, torch.bfloat16)
        out = vocab_shard_embedding(ids, block, start, size)
        assert torch.equal(out, vocab_shard_embedding_ref(ids, block, start, size))
        total += out.double()
    assert torch.equal(total, _table(torch.bfloat16)[ids].double())


def _rank(rank: int, world: int, buffers, results, dtype: torch.dtype, hidden: int) -> None:
    from tgi_compat.kernels.comm.one_shot_all_reduce import one_shot_all_reduce_

    target = PushTarget(
        torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
        torch.zeros(MAX_PROGRAMS, dtype=torch.int32),
        CAPACITY,
        rank,
    )
    block, start, size = _block(rank, world, dtype, hidden)
    for step in range(len(STEPS)):
        ids = _ids(step)
        plain = vocab_shard_embedding(ids, block, start, size)
        unfused = one_shot_all_reduce_(plain, target.buffer_ptrs, target.halves, CAPACITY, rank)
        pushed = vocab_shard_embedding(ids, block, start, size, push=target)
        one_shot_all_reduce_(pushed, target.buffer_ptrs, target.halves, CAPACITY, rank, sent=True)
        assert torch.equal(pushed, unfused), (rank, step)
        results[rank][step, : ids.numel()] = pushed.float()


@pytest.mark.parametrize(
    ("world", "dtype", "hidden"), [(2, torch.bfloat16, 3000), (3, torch.float16, 3000), (2, torch.bfloat16, 2048)]
)
def test_pushed_lookups_sum_to_the_tables_rows(world: int, dtype: torch.dtype, hidden: int, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import the kernels interpreted
    buffers = [torch.full((2 * world * CAPACITY,), SENTINEL, dtype=torch.int16).share_memory_() for _ in range(world)]
    results = [torch.full((len(STEPS), max(STEPS), hidden), float("nan")).share_memory_() for _ in range(world)]

    run_ranks(_rank, world, world, buffers, results, dtype, hidden)

    table = _table(dtype, hidden)
    for rank in range(world):
        for step in range(len(STEPS)):
            ids = _ids(step)
            assert torch.equal(results[rank][step, : ids.numel()], table[ids].float()), (rank, step)
    for buffer in buffers:
        assert (buffer == SENTINEL).all()


PROBE = r"""
import json, re, torch
from benchmarks.compile_only import compiled_ptx, install_compile_only_driver
install_compile_only_driver()
from tgi_compat.kernels.comm import one_shot_all_reduce as ar, vocab_embedding as ve
found = {}
for world in (2, 4):
    target = ar.PushTarget(torch.zeros(world, dtype=torch.int64), torch.zeros(ar.MAX_PROGRAMS, dtype=torch.int32),
                           1 << 19, 0)
    ids, weight = torch.zeros(8, dtype=torch.int64), torch.zeros(100, 4096, dtype=torch.bfloat16)
    for push in (None, target):
        ptx = compiled_ptx(ve._vocab_shard_embedding_kernel,
                           lambda: ve.vocab_shard_embedding(ids, weight, 0, 100, push=push))
        ops = re.findall(r"\b(ld|st)(\.volatile)?\.global(\.\w+)*?\.(v4\.b32|b16|b32|b64|u16)\b", ptx)
        found[f"{world} push {push is not None}"] = sorted({f"{op}{vol}.{width}" for op, vol, _, width in ops})
print(json.dumps(found))
"""


def test_lookup_compiles_to_16_byte_loads_and_stores():
    """Compiled for sm_90 (no GPU: benchmarks/compile_only.py), at Llama's hidden size the rows are read,
    stored and sent to the peers in 16-byte vectors: no two-byte access anywhere."""
    from benchmarks.compile_only import run_probe

    found = run_probe(PROBE)
    assert isinstance(found, dict) and len(found) == 4, found
    for name, widths in found.items():
        assert {"ld.v4.b32", "st.v4.b32"} <= set(widths), (name, widths)
        assert not any(w.endswith(("b16", "u16")) for w in widths), (name, widths)
