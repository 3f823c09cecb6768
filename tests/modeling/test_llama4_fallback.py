"""Llama 4's text model (`Llama4ForCausalLM`) through the transformers fallback (models/llama4.py): logits and greedy
ids equal transformers' for a prompt longer than its attention chunk, whole and as a chunk over a cached prefix beside
another request's decode; neither the chunk nor the NoPE layers' query temperature can be left out."""

from __future__ import annotations

import pytest
import torch

from tests.modeling import helpers
from tests.modeling.helpers import full_logits, hf_logits, max_rel_error, run_step
from tests.modeling.llama4_helpers import CHUNK, tiny_llama4_text
from tgi_compat.modeling.models.llama4 import Llama4ForCausalLM
from tgi_compat.modeling.registry import TRANSFORMERS

PROMPT = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()  # past three chunks


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_llama4_text()
    runner = helpers.runner_for_folder(helpers.saved_checkpoint(model, tmp_path_factory, "llama4-text"))
    assert runner.modeling_path == TRANSFORMERS and isinstance(runner.model, Llama4ForCausalLM)
    return model, runner


def test_logits_match_transformers_past_the_chunk(pair):
    model, runner = pair
    assert len(PROMPT) > 3 * CHUNK
    assert max_rel_error(full_logits(runner, PROMPT), hf_logits(model, PROMPT)) <= 1e-4


def test_chunk_over_a_cached_prefix_beside_a_decode_matches_transformers(pair):
    model, runner = pair
    other = PROMPT[::-1][:13]
    run_step(runner, [(2, PROMPT[:11], 0, list(range(300, 311))), (3, other[:12], 0, list(range(400, 412)))])
    chunk, decode = run_step(runner, [(2, PROMPT[11:], 11, list(range(311, 330))), (3, other[12:], 12, [412])])
    assert max_rel_error(chunk, hf_logits(model, PROMPT)[11:]) <= 1e-4
    assert max_rel_error(decode, hf_logits(model, other)[12:]) <= 1e-4


def test_greedy_ids_equal_transformers_generate(pair):
    model, runner = pair
    new = 12  # decode steps cross a chunk edge
    ids, slots = list(PROMPT[:20]), list(range(600, 620))
    step = run_step(runner, [(4, ids, 0, slots)])[0]
    for _ in range(new):
        ids.append(int(step[-1].argmax()))
        slots.append(slots[-1] + 1)
        step = run_step(runner, [(4, ids[-1:], len(ids) - 1, slots[-1:])])[0]
    assert ids[20:] == helpers.transformers_greedy(model, PROMPT[:20], eos_id=-1, max_new_tokens=new)


def test_the_chunk_and_the_query_temperature_each_change_the_logits(pair, monkeypatch):
    """The cases above would pass without either: drop each and the logits leave transformers'."""
    model, runner = pair
    expected = hf_logits(model, PROMPT)
    layers = len(runner.model.attention_chunks)
    monkeypatch.setattr(runner.model, "attention_chunks", [None] * layers)
    assert max_rel_error(full_logits(runner, PROMPT), expected) > 1e-2
    monkeypatch.undo()
    monkeypatch.setattr(runner.model, "query_scales", lambda positions: {})
    assert max_rel_error(full_logits(runner, PROMPT), expected) > 1e-3


def test_serves_random_weights_from_config_json_alone(tmp_path):
    """--load-format dummy (the GPU benchmarks'): the MoE experts' stacked tensors are streamed in as any other."""
    from tests.modeling.llama4_helpers import tiny_llama4_text_config
    from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

    config = tiny_llama4_text_config()
    config.architectures = ["Llama4ForCausalLM"]
    config.save_pretrained(tmp_path)
    cfg = RunnerConfig(model_id=str(tmp_path), device="cpu", dtype="float32", num_kv_slots=64, show_progress=False)
    cfg.load_format = "dummy"
    logits = full_logits(ModelRunner(cfg), PROMPT[:20])
    assert logits.shape == (20, 256) and torch.isfinite(logits).all() and logits.std() > 0
