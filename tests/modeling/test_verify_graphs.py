"""Verify-step CUDA graphs' static inputs and padding, and the startup step-cost measurement, on CPU: the
graph's replay stands in as an eager run of its static batch (capture needs CUDA; tests/gpu captures)."""

from __future__ import annotations

import torch

from tests.modeling.helpers import run_step, tiny_runner
from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs, verify_batch_sizes
from tgi_compat.modeling.forward_batch import ForwardMode, build_forward_batch
from tgi_compat.modeling.step_cost import measure_step_costs


class _EagerReplay:
    """Stands in for a captured graph: replay() runs the step on the static inputs into the same output."""

    def __init__(self, graphs: DecodeCudaGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        graphs = self.graphs
        graphs.outputs[self.size, False].copy_(graphs.graph_step(self.size, with_lora=False)())


def _stand_in_capture(graphs: DecodeCudaGraphs) -> None:
    for size in graphs.batch_sizes:
        graphs.outputs[size, False] = graphs.graph_step(size, with_lora=False)().clone()
        graphs.graphs[size, False] = _EagerReplay(graphs, size)  # type: ignore[assignment]


def test_a_verify_step_through_the_padded_static_inputs_equals_the_eager_step():
    torch.manual_seed(0)
    _, runner = tiny_runner()
    prompts = [[5, 9, 11, 3, 7], [2, 4, 6]]
    run_step(runner, [(row, p, 0, [row * 64 + i for i in range(len(p))]) for row, p in enumerate(prompts)])
    q = 3  # the last prompt token and two drafts per request, at positions len(p) - 1 ..
    tokens = [[7, 8, 9], [6, 1, 2]]
    batch = build_forward_batch(
        input_ids=[t for ts in tokens for t in ts],
        req_rows=[0, 1],
        q_lens=[q, q],
        kv_lens=[len(p) - 1 + q for p in prompts],
        out_slots=[row * 64 + len(p) - 1 + j for row, p in enumerate(prompts) for j in range(q)],
        logits_indices=list(range(2 * q)),
    )
    assert batch.mode == ForwardMode.EXTEND
    eager = runner._forward_eager(batch).clone()
    graphs = DecodeCudaGraphs(
        runner._forward_eager,
        [1, 4],
        pad_row=runner.max_rows,
        pad_slot=runner.num_kv_slots,
        max_seq_len=runner.max_seq_len,
        device=runner.device,
        tokens_per_row=q,
    )
    _stand_in_capture(graphs)
    assert graphs.can_run(batch)
    replayed = graphs.replay(batch)  # 2 requests in the bucket of 4: 2 padding requests of 3 tokens
    torch.testing.assert_close(replayed, eager)
    inputs = graphs.inputs
    assert inputs.positions[6:12].tolist() == [0, 1, 2, 0, 1, 2]
    assert inputs.out_slots[6:12].tolist() == [runner.num_kv_slots] * 6
    assert inputs.req_rows[2:4].tolist() == [runner.max_rows] * 2 and inputs.kv_lens[2:4].tolist() == [q, q]
    # other shapes go eager: another q, a ragged step, a decode step
    ragged = build_forward_batch([1, 2, 3, 4], [0, 1], [3, 1], [8, 4], [500, 501, 502, 503], [0, 1, 2, 3])
    decode = build_forward_batch([1, 2], [0, 1], [1, 1], [5, 3], [500, 501], [0, 1])
    assert not graphs.can_run(ragged) and not graphs.can_run(decode)


def test_verify_graphs_cover_the_small_decode_buckets():
    assert verify_batch_sizes([1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256]) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert verify_batch_sizes([128]) == []


def test_the_step_cost_table_is_measured_on_the_reserved_row():
    torch.manual_seed(0)
    _, runner = tiny_runner()
    row_before = runner.req_to_token[: runner.max_rows].clone()
    rows, seconds = measure_step_costs(runner, rows=(1, 2, 8, 64, 512), repeats=1)
    assert rows == (1, 2, 8, 64)  # decode rows up to max_rows (8, eager on CPU), then one request of n <= 256
    assert all(s > 0 for s in seconds)
    assert torch.equal(runner.req_to_token[: runner.max_rows], row_before)  # no live row touched
