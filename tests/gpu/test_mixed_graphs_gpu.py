"""Mixed-step CUDA graphs on the GPU (marker `gpu`; skipped without CUDA): a mixed step replayed from its graph
gives the eager step's logits at several buckets and chunk shapes, and an engine with --max-mixed-prefill-tokens
(its mixed steps replayed) gives the greedy tokens of one without.

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_mixed_graphs_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.device.overlap import TINY_LLAMA
from benchmarks.device.steps import build_runner, engine_tokens, hf_model, prefill
from tgi_compat.modeling.forward_batch import ForwardMode, build_forward_batch
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest, SamplingParams

no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_LEN, NUM_ROWS, CAP = 512, 8, 64


def _runner():
    torch.manual_seed(0)
    model, hf_config = hf_model(TINY_LLAMA, torch.float32, "cuda")
    sizes = [1, 2, 4, 8]
    return build_runner(
        hf_config, model.state_dict(), "float32", "triton", NUM_ROWS, MAX_LEN, "cuda", sizes, mixed_prefill_tokens=CAP
    )


@pytest.mark.gpu
@no_gpu
def test_a_mixed_step_replayed_from_its_graph_equals_the_eager_step():
    runner = _runner()
    assert runner.mixed_graphs is not None and sorted(runner.mixed_graphs.graphs) == [1, 2, 4, 8]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (37, 5, 120, 9, 200)]
    prefill(runner, prompts, MAX_LEN)
    kv = {row: len(p) for row, p in enumerate(prompts)} | {5: 0, 6: 0}
    cases = [
        [(0, 1), (1, 1), (2, 1), (5, 40)],  # three decodes (bucket 4) and a new 40-token prompt in row 5
        [(0, 1), (5, 24), (6, 7)],  # one decode (bucket 1), row 5's next 24 tokens, a new 7-token prompt
        [(6, 3), (0, 1), (1, 1), (2, 1)],  # a chunk first: no decode prefix, the decodes on the chunk side
    ]
    for case in cases:
        rows, q_lens = [row for row, _ in case], [q for _, q in case]
        starts = [kv[row] for row in rows]
        batch = build_forward_batch(
            input_ids=[rng.randrange(3, 2000) for _ in range(sum(q_lens))],
            req_rows=rows,
            q_lens=q_lens,
            kv_lens=[s + q for s, q in zip(starts, q_lens)],
            out_slots=[row * MAX_LEN + s + j for row, s, q in zip(rows, starts, q_lens) for j in range(q)],
            logits_indices=(torch.tensor(q_lens).cumsum(0) - 1).tolist(),
            device="cuda",
        )
        assert batch.mode == ForwardMode.MIXED and runner.mixed_graphs.can_run(batch)
        replayed = runner.forward(batch).clone()
        eager = runner._forward_eager(batch)
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        kv.update({row: s + q for row, s, q in zip(rows, starts, q_lens)})


@pytest.mark.gpu
@no_gpu
def test_an_engine_replaying_mixed_steps_gives_the_tokens_of_one_without():
    runner = _runner()
    graphs = runner.mixed_graphs
    replays = 0

    def counted(batch, replay=graphs.replay):
        nonlocal replays
        replays += 1
        return replay(batch)

    graphs.replay = counted  # type: ignore[method-assign]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(4, 300))] for _ in range(12)]
    outputs = []
    for cap in (None, CAP):
        config = EngineConfig(model_id="random", max_running_requests=NUM_ROWS, max_mixed_prefill_tokens=cap)
        engine = EngineCore(config, runner, runner.model_config)
        requests = [
            GenerateRequest(f"r{i}", p, SamplingParams(), max_new_tokens=24 + i, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        outputs.append(engine_tokens(engine, requests))
        assert engine.pool.is_full_free()
    assert outputs[1] == outputs[0]
    assert replays > 0  # the capped engine's mixed steps ran from their graphs
