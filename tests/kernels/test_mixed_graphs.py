"""Mixed-step graphs' layout (tgi_compat/modeling/mixed_graphs.py), run eagerly over the static inputs as a replay
would (CPU: no capture): the logits of a mixed step equal its own eager forward's, with the torch backend and with
the Triton one (interpreted, whose decode prefix the layout fixes); steps that do not fit a graph are left eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_triton_backend import MAX_LEN, make_runner
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from tgi_compat.modeling.mixed_graphs import MAX_CHUNKS, MixedCudaGraphs
from tgi_compat.modeling.runner import ModelRunner

CAP = 8  # --max-mixed-prefill-tokens


def step(requests: list[tuple[int, list[int], int]]) -> ForwardBatch:
    """(row, new token ids, kv_len after the step) per request; logits at each request's last token."""
    q_lens = [len(ids) for _, ids, _ in requests]
    slots = [row * MAX_LEN + pos for row, ids, kv in requests for pos in range(kv - len(ids), kv)]
    last = (torch.tensor(q_lens).cumsum(0) - 1).tolist()
    return build_forward_batch(
        input_ids=[t for _, ids, _ in requests for t in ids],
        req_rows=[row for row, _, _ in requests],
        q_lens=q_lens,
        kv_lens=[kv for _, _, kv in requests],
        out_slots=slots,
        logits_indices=last,
    )


def graphs_of(runner: ModelRunner) -> MixedCudaGraphs:
    return MixedCudaGraphs(
        runner._forward_eager,
        [1, 2, 4],
        CAP,
        pad_row=runner.max_rows,
        pad_slot=runner.num_kv_slots,
        max_seq_len=MAX_LEN,
        device=runner.device,
    )


def prefilled(weights, backend: str) -> ModelRunner:
    """Rows 0 and 1 hold 6- and 9-token prompts, row 2 the first 4 tokens of an 11-token one."""
    runner = make_runner(weights, backend)
    runner.forward(step([(0, [3, 5, 7, 9, 11, 13], 6), (1, list(range(20, 29)), 9), (2, [40, 41, 42, 43], 4)]))
    return runner


CASES = {
    # two decodes lead, then row 2's next 5 prompt tokens and a new 2-token prompt in row 3
    "decodes-first": [(0, [15], 7), (1, [30], 10), (2, [44, 45, 46, 47, 48], 9), (3, [60, 61], 2)],
    # a chunk first: no leading decode (the bucket's decode side is all padding), then the decodes go chunk-side
    "chunk-first": [(2, [44, 45, 46], 7), (0, [15], 7), (1, [30], 10)],
    # the cap filled exactly by one chunk beside one decode (the last padding request gets MAX_CHUNKS - 1 + 1 tokens)
    "cap-filled": [(1, [30], 10), (2, [44, 45, 46, 47, 48, 49, 50, 51], 12)],
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mixed_step_replayed_over_the_static_inputs_gives_its_eager_logits(tiny_weights, backend, case):
    runner = prefilled(tiny_weights, backend)
    graphs = graphs_of(runner)
    batch = step(CASES[case])
    assert batch.mode == ForwardMode.MIXED
    expected = runner._forward_eager(batch).clone()
    layout = graphs.load_inputs(batch)
    got = graphs.graph_step(layout.bucket)()[: batch.logits_indices.shape[0]]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if backend == "triton":  # the bucket's decode side went through flash-decoding, the chunk side through extend
        assert runner.backend.metadata.num_decode_prefix == layout.bucket
        assert runner.backend.metadata.max_q_len == CAP + MAX_CHUNKS
    # the padding wrote only the reserved slot of the reserved row
    assert set(graphs.inputs.out_slots[: layout.num_tokens].tolist()) - set(batch.out_slots.tolist()) <= {
        runner.num_kv_slots
    }
    assert set(graphs.inputs.req_rows[: layout.num_requests].tolist()) - set(batch.req_rows.tolist()) <= {
        runner.max_rows
    }


def test_a_second_step_after_a_larger_one_reads_no_stale_inputs(tiny_weights):
    runner = prefilled(tiny_weights, "torch")
    graphs = graphs_of(runner)
    graphs.load_inputs(step(CASES["decodes-first"]))  # bucket 2, every chunk slot used
    small = step([(0, [15], 7), (2, [44, 45], 6)])
    expected = runner._forward_eager(small).clone()
    layout = graphs.load_inputs(small)
    assert (layout.bucket, layout.lead, layout.num_chunks, layout.chunk_tokens) == (1, 1, 1, 2)
    got = graphs.graph_step(layout.bucket)()[:2]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_steps_that_no_graph_holds_run_eager(tiny_weights):
    runner = prefilled(tiny_weights, "torch")
    graphs = graphs_of(runner)
    assert graphs.can_run(step(CASES["decodes-first"]))
    too_long = step([(0, [15], 7), (2, list(range(44, 44 + CAP + 1)), 4 + CAP + 1)])
    assert not graphs.can_run(too_long)  # more prompt tokens than the cap
    many = [(0, [15], 7)] + [(row, [50, 51], 2) for row in range(1, 1 + MAX_CHUNKS + 1)]
    assert not graphs.can_run(step(many))  # more chunks than MAX_CHUNKS
    decodes = step([(0, [15], 7), (1, [30], 10)])
    assert decodes.mode == ForwardMode.DECODE and not graphs.can_run(decodes)  # the decode graphs' step
    fits = step(CASES["cap-filled"])
    assert not graphs.can_run(dataclasses.replace(fits, q_lens_cpu=None))  # no host lengths: no layout
    prompt_scores = dataclasses.replace(fits, logits_indices=torch.arange(fits.num_tokens))
    assert not graphs.can_run(prompt_scores)  # a logits row per prompt token: more than one per request


def test_the_capture_records_over_padding_alone(tiny_weights):
    runner = prefilled(tiny_weights, "torch")
    graphs = graphs_of(runner)
    graphs.load_padding(2)
    batch = graphs.static_batch(2)
    assert set(batch.out_slots.tolist()) == {runner.num_kv_slots} and set(batch.req_rows.tolist()) == {runner.max_rows}
    assert batch.q_lens.tolist() == [1, 1] + [1] * MAX_CHUNKS + [CAP] and batch.q_lens.sum() == batch.num_tokens
    assert graphs.graph_step(2)().isfinite().all()
