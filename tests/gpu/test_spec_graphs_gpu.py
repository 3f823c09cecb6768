"""Speculative decoding on the GPU (marker `gpu`; skipped without CUDA): a verify step replayed from its CUDA
graph gives the eager step's logits, and greedy output with 4 drafts (steps padded to one draft length, replayed
as verify graphs, the measured step-cost table deciding) equals --speculate 0's.

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_spec_graphs_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.device.overlap import TINY_LLAMA
from benchmarks.device.steps import build_runner, hf_model, prefill
from tgi_compat.modeling.forward_batch import ForwardMode, build_forward_batch
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.model_loading import tune_speculation
from tgi_compat.router.request import GenerateRequest, SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig

no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_LEN, NUM_ROWS = 512, 8


def _runner(device: str = "cuda"):
    torch.manual_seed(0)
    model, hf_config = hf_model(TINY_LLAMA, torch.float32, device)
    backend = "triton" if device == "cuda" else "torch"
    return build_runner(
        hf_config, model.state_dict(), "float32", backend, NUM_ROWS, MAX_LEN, device, [1, 2, 4, 8],
        num_speculative_tokens=4,
    )  # fmt: skip


@pytest.mark.gpu
@no_gpu
def test_a_verify_step_replayed_from_its_graph_equals_the_eager_step():
    runner = _runner()
    assert sorted(runner.verify_graphs) == [2, 3, 4, 5] and runner.verify_graph_max_batch == 8
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (37, 5, 120)]
    prefill(runner, prompts, MAX_LEN)
    for q in (2, 5):
        starts = [len(p) - 1 for p in prompts]  # each request's last prompt token, then q - 1 drafts
        batch = build_forward_batch(
            input_ids=[t for p in prompts for t in [p[-1]] + [rng.randrange(3, 2000) for _ in range(q - 1)]],
            req_rows=[0, 1, 2],
            q_lens=[q] * 3,
            kv_lens=[s + q for s in starts],
            out_slots=[i * MAX_LEN + s + j for i, s in enumerate(starts) for j in range(q)],
            logits_indices=list(range(3 * q)),
            device="cuda",
        )
        assert batch.mode == ForwardMode.EXTEND and runner.verify_graphs[q].can_run(batch)
        replayed = runner.forward(batch).clone()  # bucket 4: one padding request
        eager = runner._forward_eager(batch)
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@no_gpu
def test_greedy_output_with_four_drafts_equals_speculate_zero():
    runner = _runner()
    speculative = tune_speculation(SpeculativeConfig(4), runner)
    assert speculative.uniform_max_batch == 8 and speculative.step_cost is not None
    print("step cost", speculative.step_cost)
    _check_greedy_equal(runner, speculative)


def test_the_greedy_check_on_the_cpu():
    """The same engine path on the CPU (no graphs: the padding to one draft length is forced)."""
    runner = _runner("cpu")
    assert tune_speculation(SpeculativeConfig(4), runner).uniform_max_batch == 0
    _check_greedy_equal(runner, SpeculativeConfig(4, uniform_max_batch=8))


def _check_greedy_equal(runner, speculative: SpeculativeConfig) -> None:
    replays = {q: 0 for q in runner.verify_graphs}
    for q, graphs in runner.verify_graphs.items():

        def counted(batch, q=q, replay=graphs.replay):
            replays[q] += 1
            return replay(batch)

        graphs.replay = counted  # type: ignore[method-assign]
    rng = random.Random(1)
    motifs = [[rng.randrange(3, 2000) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    prompts = [motif * 6 for motif in motifs]  # repetition: n-gram drafts to verify
    outputs = {}
    for config in (None, speculative):
        engine = EngineCore(
            EngineConfig(model_id="random", max_running_requests=NUM_ROWS, speculative=config),
            runner,
            runner.model_config,
        )
        for i, prompt in enumerate(prompts):
            params = GenerateRequest(f"r{i}", prompt, SamplingParams(), max_new_tokens=40 + 9 * i, ignore_eos=True)
            engine.add_request(params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for event in engine.step():
                tokens.setdefault(event.request_id, []).extend(event.token_ids)
        assert engine.pool.is_full_free()
        outputs[config is not None] = tokens
        if config is not None:
            counters = engine.scheduler.speculator.counters
            print("drafts", counters.num_drafts, "accepted", counters.num_accepted_tokens, "replays", replays)
            assert counters.num_accepted_tokens > 0
    assert outputs[True] == outputs[False]
    if runner.verify_graphs:
        assert sum(replays.values()) > 0  # verify steps ran from their graphs
