"""The CUDA graphs' static inputs where features meet (LoRA slots, verify steps, --diverse_mode's group table,
M-RoPE rows), on CPU: each graph's replay stands in as an eager run of what it records, whose batch the step
function inspects (capture needs CUDA; tests/gpu captures)."""

from __future__ import annotations

import torch

from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs
from tgi_compat.modeling.forward_batch import ForwardBatch, LoraBatch, PrefixGroups, build_forward_batch


class _Slots:
    """The LoRA side as the graphs see it: the slots each graph step sets (None: a plain step, or the end)."""

    def __init__(self) -> None:
        self.calls: list[list[int] | None] = []

    def set_decode_slots(self, slots: torch.Tensor | None) -> None:
        self.calls.append(None if slots is None else slots.tolist())


def _eager_graphs(graphs: DecodeCudaGraphs) -> None:
    class Replay:
        def __init__(self, size: int, with_lora: bool) -> None:
            self.step = graphs.graph_step(size, with_lora)

        def replay(self) -> None:
            self.step()
            graphs.end_graph_steps()

    for size in graphs.batch_sizes:
        for with_lora in (False, True):
            graphs.outputs[size, with_lora] = torch.zeros(size * graphs.tokens_per_row, 3)
            graphs.graphs[size, with_lora] = Replay(size, with_lora)  # type: ignore[assignment]


def _recorder(seen: list[ForwardBatch]):
    def step_fn(batch: ForwardBatch) -> torch.Tensor:
        seen.append(batch)
        return torch.zeros(batch.num_tokens, 3)

    return step_fn


def test_a_lora_decode_step_with_prefix_groups_replays_the_lora_graph_with_both_tables():
    seen: list[ForwardBatch] = []
    lora = _Slots()
    graphs = DecodeCudaGraphs(
        _recorder(seen), [4], pad_row=8, pad_slot=100, max_seq_len=64, device="cpu", lora=lora, prefix_group_max=2
    )
    _eager_graphs(graphs)
    step = build_forward_batch([5, 6, 7], [0, 1, 2], [1, 1, 1], [9, 9, 4], [20, 21, 22], [0, 1, 2])
    step.lora = LoraBatch(torch.tensor([1, -1, 0]))
    step.prefix_groups = PrefixGroups(torch.tensor(PrefixGroups.rows([(8, [1, 0])], 3, 2)))
    assert graphs.can_run(step)
    graphs.replay(step)
    assert lora.calls[-2:] == [[1, -1, 0, -1], None]  # the LoRA graph ran, its padding row on the base model
    groups = seen[-1].prefix_groups
    assert groups is not None and groups.table.tolist() == [[8, 1, 0], [8, -1, -1], [0, -1, -1], [0, -1, -1]]


def test_a_verify_step_of_an_mrope_model_carries_its_rope_rows_and_a_lora_one_runs_eager():
    seen: list[ForwardBatch] = []
    q = 2
    graphs = DecodeCudaGraphs(
        _recorder(seen), [4], pad_row=8, pad_slot=100, max_seq_len=64, device="cpu", tokens_per_row=q, mrope=True
    )
    _eager_graphs(graphs)
    step = build_forward_batch([5, 6, 7, 8, 9, 10], [0, 1, 2], [q] * 3, [9, 9, 4], list(range(20, 26)), list(range(6)))
    rope = torch.tensor([[7, 8, 20, 21, 2, 3], [7, 8, 30, 31, 2, 3], [7, 8, 40, 41, 2, 3]])
    step.rope_positions = rope
    assert graphs.can_run(step)
    graphs.replay(step)
    replayed = seen[-1].rope_positions
    assert replayed is not None and replayed.shape == (3, 4 * q)
    assert replayed[:, : 3 * q].tolist() == rope.tolist()
    assert replayed[:, 3 * q :].tolist() == [[0, 1]] * 3  # the padding request rotates by its positions 0..q-1
    step.rope_positions = None  # a text-only step: every row rotates by its plain positions
    graphs.replay(step)
    replayed = seen[-1].rope_positions
    assert replayed is not None and replayed[:, : 3 * q].tolist() == [[7, 8, 7, 8, 2, 3]] * 3
    step.lora = LoraBatch(torch.tensor([0, -1, -1]))
    assert not graphs.can_run(step)  # verify graphs are captured without LoRA


def test_verify_graphs_never_replay_a_step_with_prefix_groups():
    graphs = DecodeCudaGraphs(
        _recorder([]), [4], pad_row=8, pad_slot=100, max_seq_len=64, device="cpu", tokens_per_row=2
    )
    step = build_forward_batch([5, 6, 7, 8], [0, 1], [2, 2], [9, 4], [20, 21, 22, 23], [0, 1, 2, 3])
    assert graphs.can_run(step)
    step.prefix_groups = PrefixGroups(torch.tensor(PrefixGroups.rows([], 2, 2)))
    assert not graphs.can_run(step)
