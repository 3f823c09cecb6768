"""EAGLE-3 on the GPU (marker `gpu`; skipped without CUDA): the auxiliary hidden states a decode step replayed from
its CUDA graph writes are the eager step's and the layers' outputs, and greedy output with a tiny random head (Triton
backend, decode and verify graphs) equals --speculate 0's, leaving the KV pool full.

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_eagle3_gpu.py
Under tensor parallelism (2 GPUs): tests/gpu/check_eagle3_tp.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.modeling.eagle3_heads import TARGET, random_head_tensors, save_head
from tests.modeling.helpers import run_step
from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.router.request import GenerateRequest, SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.policy import StepCostTable

no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("eagle3-gpu") / "target"
    LlamaForCausalLM(LlamaConfig(**TARGET, bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    return folder


@pytest.mark.gpu
@no_gpu
def test_replayed_decode_steps_write_the_eager_aux_hidden_states():
    from transformers import LlamaConfig

    from tests.modeling.helpers import tiny_hf_model
    from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

    hf = tiny_hf_model(LlamaConfig, **TARGET)
    hf_config = {**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    cfg = RunnerConfig(
        device="cuda",
        dtype="float32",
        num_kv_slots=1024,
        max_rows=8,
        max_seq_len=256,
        cuda_graph_batch_sizes=[1, 2, 4],
        aux_hidden_layers=(0, 1, 3),
    )
    runner = ModelRunner.from_hf_state_dict(hf_config, hf.state_dict(), cfg)
    assert runner.aux_hidden is not None and runner.cuda_graphs is not None
    run_step(runner, [(0, [5, 9, 13], 0, [0, 1, 2]), (1, [7, 8], 0, [10, 11])])
    batch = build_forward_batch([21, 22], [0, 1], [1, 1], [4, 3], [3, 12], [0, 1], device="cuda")
    assert runner.cuda_graphs.can_run(batch)
    runner.forward(batch)
    replayed = runner.aux_hidden.rows(2).clone()
    runner._forward_eager(batch)
    torch.testing.assert_close(replayed, runner.aux_hidden.rows(2), atol=1e-5, rtol=1e-5)
    # the layers' outputs, read from the fused kernels' sums (transformers' hidden states: its last entry is normed)
    hidden = TARGET["hidden_size"]
    with torch.no_grad():
        for row, ids in enumerate(([5, 9, 13, 21], [7, 8, 22])):
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            expected = torch.cat([states[layer + 1][0, -1] for layer in (0, 1)])
            torch.testing.assert_close(replayed[row, : 2 * hidden].cpu(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@no_gpu
def test_eagle3_greedy_output_is_speculate_0s(target_dir, tmp_path):
    from tgi_compat.router.config import EngineConfig
    from tgi_compat.router.engine import EngineCore

    head = save_head(tmp_path / "head", "speculators", random_head_tensors())
    prompts = [[1 + (i * 37 + j * 11) % 250 for j in range(3 + 17 * i)] for i in range(6)]
    outputs = []
    # a random head on a tiny target costs about a target step: a flat table (verify rows for free, 1 s a step
    # against the head's measured milliseconds) makes every draft pay, so the head drafts and is checked
    flat = StepCostTable(rows=(1, 512), seconds=(1.0, 1.001))
    eagle3 = SpeculativeConfig(num_speculative_tokens=3, method="eagle3", draft_model=head, step_cost=flat)
    for speculative in (None, eagle3):
        config = EngineConfig(
            model_id=str(target_dir),
            device="cuda",
            dtype="float32",
            max_batch_total_tokens=4096,
            max_running_requests=8,
            speculative=speculative,
        )
        engine = EngineCore.from_config(config)
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(), max_new_tokens=48, ignore_eos=True))
        events: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for event in engine.step():
                events.setdefault(event.request_id, []).extend(event.token_ids)
        assert engine.pool.is_full_free()
        outputs.append(events)
        if speculative is not None:
            assert engine.scheduler.speculator is not None
            assert engine.scheduler.speculator.counters.num_draft_tokens > 0
    assert outputs[1] == outputs[0]


@pytest.mark.gpu
@no_gpu
def test_the_heads_drafting_time_is_measured_on_the_gpu(tmp_path):
    from tgi_compat.modeling.models.eagle3 import load_eagle3_head
    from tgi_compat.modeling.step_cost import HEAD_COST_BATCHES
    from tgi_compat.router.model_loading import measure_head_cost

    folder = save_head(tmp_path / "head", "speculators", random_head_tensors())
    cuda, vocab = torch.device("cuda"), TARGET["vocab_size"]
    head = load_eagle3_head(folder, vocab, torch.randn(vocab, TARGET["hidden_size"], device=cuda), cuda, torch.float32)
    cost = measure_head_cost(head)  # what the engine measures at startup beside the step-cost table
    assert cost.fixed.rows == cost.per_draft.rows == HEAD_COST_BATCHES
    assert 0 < cost.cost(1, 1) < 0.05  # an eager forward or two: well under a step of a real model times ten
    assert cost.cost(64, 4) > cost.cost(64, 1) > 0
