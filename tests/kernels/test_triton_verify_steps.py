"""Speculative verify steps through the Triton backend (kernels interpreted on CPU): a verify chunk's rows
attend through the extend kernel while a plain decode runs flash-decoding, so greedy output with drafts must
still equal the plain path's; and the verify graphs' padded static batch gives the eager step's logits."""

from __future__ import annotations

import torch
from test_triton_backend import MAX_LEN, make_runner

from benchmarks.device.steps import engine_tokens
from tests.modeling.test_verify_graphs import _stand_in_capture
from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs
from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest, SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig


def test_padded_verify_inputs_through_the_triton_backend_equal_the_eager_step(tiny_weights):
    runner = make_runner(tiny_weights, "triton")
    prompts = [[3, 14, 15, 9, 2, 6, 5], [11, 12, 13]]
    prefill = build_forward_batch(
        [t for p in prompts for t in p], [0, 1], [7, 3], [7, 3], [*range(7), *range(48, 51)], [6, 9]
    )
    runner.forward(prefill)
    q = 3
    batch = build_forward_batch(
        input_ids=[5, 20, 21, 13, 22, 23],
        req_rows=[0, 1],
        q_lens=[q, q],
        kv_lens=[6 + q, 2 + q],
        out_slots=[6, 7, 8, 50, 51, 52],
        logits_indices=list(range(2 * q)),
    )
    eager = runner._forward_eager(batch).clone()
    graphs = DecodeCudaGraphs(
        runner._forward_eager, [4], runner.max_rows, runner.num_kv_slots, MAX_LEN, runner.device, tokens_per_row=q
    )
    _stand_in_capture(graphs)
    torch.testing.assert_close(graphs.replay(batch), eager)


def test_greedy_drafts_through_the_triton_backend_give_the_plain_tokens(tiny_weights):
    runner = make_runner(tiny_weights, "triton")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [30, 31, 32, 33, 30, 31]]
    outputs, accepted = {}, 0
    for speculative in (None, SpeculativeConfig(3, uniform_max_batch=4), SpeculativeConfig(3)):
        engine = EngineCore(
            EngineConfig(model_id="tiny", max_running_requests=3, speculative=speculative), runner, runner.model_config
        )
        requests = [
            GenerateRequest(f"r{i}", prompt, SamplingParams(), max_new_tokens=10 + 3 * i, ignore_eos=True)
            for i, prompt in enumerate(prompts)
        ]
        outputs[speculative] = engine_tokens(engine, requests)
        assert engine.pool.is_full_free()
        if engine.scheduler.speculator is not None:
            accepted += engine.scheduler.speculator.counters.num_accepted_tokens
    plain = outputs.pop(None)
    assert all(tokens == plain for tokens in outputs.values())
    assert accepted > 0
