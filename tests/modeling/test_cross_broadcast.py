"""A cross-attending model's steps through StepBroadcast (gloo, 2 ranks; parallel/cross_broadcast.py): the other
rank gets each step's rows, MLP factors and runs, makes the keys of the entries a step makes from the vision states
sent with it, and keeps them, by rank 0's ids, only while rank 0's store holds them."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tests.benchmarks.conftest import free_port
from tgi_compat.modeling.forward_batch import CrossAttention, CrossRun, ForwardBatch, build_forward_batch
from tgi_compat.modeling.parallel import init_tensor_parallel
from tgi_compat.modeling.parallel.cross_broadcast import CrossKeysFollower
from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
from tgi_compat.router.process_exit import exit_process

STATES = [torch.arange(12.0).view(3, 4), -torch.arange(8.0).view(2, 4)]  # entries 0 and 1's vision states


class _Halves:
    """Keys and values of one layer, one head: the states halved and as they are (what a rank makes of them)."""

    max_tiles = 1
    image_kv_bytes = 0

    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(states[:, None] / 2, states[:, None])]


def _steps() -> list[CrossAttention]:
    """Entry 0 made, then entry 1 made beside it, then entry 0 dropped (its request ended)."""
    rows, follows = torch.tensor([0, 1, 2]), torch.tensor([[0.0], [1.0], [1.0]])
    first = [CrossRun(0, 1, [], (0, 3), 0), CrossRun(1, 2, [], (1, 2), 0)]
    both = [CrossRun(0, 2, [], (0, 3), 0), CrossRun(2, 3, [], (0, 2), 1)]
    return [
        CrossAttention(rows[:2], follows[:2], first, [(0, STATES[0])], [0]),
        CrossAttention(rows, follows, both, [(1, STATES[1])], [0, 1]),
        CrossAttention(rows[2:], follows[2:], [CrossRun(0, 1, [], (0, 2), 1)], [], [1]),
    ]


def _rank(rank: int, port: int, path: str) -> None:
    tp = init_tensor_parallel(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    steps = StepBroadcast(tp, capacity=8)
    if rank == 0:
        for cross in _steps():
            batch = build_forward_batch([5, 6, 7], [0], [3], [3], [0, 1, 2], [2])
            batch.cross = cross
            steps.send(batch)
        steps.send_stop()
    else:
        steps.cross_keys = follower = CrossKeysFollower(_Halves())
        seen = []
        while (batch := steps.receive()) is not None:
            assert isinstance(batch, ForwardBatch) and batch.cross is not None
            cross = batch.cross
            runs = [(run.first, run.end, run.keys, run.entry, run.kv[0][0].clone()) for run in cross.runs]
            seen.append((sorted(follower.entries), cross.rows.clone(), cross.follows_image.clone(), runs))
        torch.save(seen, path)
    exit_process(0)  # as a served rank leaves (tests.modeling.tp_group)


def test_other_ranks_make_and_keep_their_keys_while_rank_zero_holds_them(tmp_path):
    path = str(tmp_path / "seen.pt")
    mp.start_processes(_rank, args=(free_port(), path), nprocs=2, start_method="spawn")
    seen = torch.load(path)
    assert [entries for entries, *_ in seen] == [[0], [0, 1], [1]]  # entry 0 dropped with the step that left it out
    for (_, rows, follows, runs), sent in zip(seen, _steps(), strict=True):
        assert torch.equal(rows, sent.rows) and torch.equal(follows, sent.follows_image)
        assert [run[:4] for run in runs] == [(r.first, r.end, r.keys, r.entry) for r in sent.runs]
        for *_, entry, keys in runs:  # made here from the states rank 0 sent
            assert torch.equal(keys, STATES[entry][:, None] / 2)
