"""The EAGLE-3 head: both checkpoint formats load to the same module, its drafts are a plain torch reference's,
the target's auxiliary hidden states are its layers' outputs, and heads that do not fit are refused."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest
import torch

from tests.modeling.eagle3_heads import AUX_LAYERS, TARGET, random_head_tensors, reference_drafts, save_head
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.models.decoder import DecoderStack
from tgi_compat.modeling.models.eagle3 import load_eagle3_head
from tgi_compat.modeling.models.eagle3_config import Eagle3Config

CPU = torch.device("cpu")
VOCAB = TARGET["vocab_size"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    tensors = random_head_tensors()
    root = tmp_path_factory.mktemp("eagle3")
    return tensors, {fmt: save_head(root / fmt, fmt, tensors) for fmt in ("speculators", "eagle")}


def _embedding(seed: int = 1) -> torch.Tensor:
    return torch.randn(VOCAB, TARGET["hidden_size"], generator=torch.Generator().manual_seed(seed))


def test_both_formats_load_the_same_head(heads):
    _, folders = heads
    embedding = _embedding()
    loaded = {fmt: load_eagle3_head(folder, VOCAB, embedding, CPU, torch.float32) for fmt, folder in folders.items()}
    assert loaded["eagle"].embed_tokens.weight.data_ptr() == embedding.data_ptr()  # the target's, shared
    first, second = loaded["speculators"].state_dict(), loaded["eagle"].state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    configs = [head.config for head in loaded.values()]
    assert [c.format for c in configs] == ["speculators", "eagle"]
    assert all(c.aux_layer_ids == tuple(AUX_LAYERS) and c.draft_vocab_size == 64 for c in configs)


def test_drafts_equal_a_torch_reference(heads):
    from tgi_compat.router.speculative.eagle3 import Eagle3Proposer

    tensors, folders = heads
    embed = _embedding()
    head = load_eagle3_head(folders["speculators"], VOCAB, embed, CPU, torch.float32)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    aux = torch.randn(len(tokens) + 3, 3 * TARGET["hidden_size"], generator=g)
    proposer = Eagle3Proposer(head)
    proposer.extend(tokens[:7])
    proposer.observe(0, aux[:7])  # a prefill of 7, then a step of 3 with one rejected position at its end
    assert proposer.propose(4) == reference_drafts(tensors, embed, tokens[:7], aux, 4)
    proposer.extend(tokens[7:9])
    proposer.observe(6, aux[6:9])  # (positions 6..8 recomputed; 8 rejected: the sequence ends at 8)
    assert proposer.propose(3) == reference_drafts(tensors, embed, tokens[:9], aux, 3)
    proposer.observe(0, aux[:5])  # preempted and prefilled again: the head's cache starts over
    proposer.extend(tokens[9:])  # (the proposer has all 12 tokens; only positions < 5 have hidden states)
    assert proposer.propose(2) == []  # no hidden state of position 10 yet
    proposer.observe(5, aux[5:11])
    assert proposer.propose(2) == reference_drafts(tensors, embed, tokens, aux, 2)


def test_the_target_writes_its_layers_outputs():
    from transformers import LlamaConfig

    from tests.modeling.helpers import run_step, tiny_hf_model
    from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

    hf = tiny_hf_model(LlamaConfig, num_hidden_layers=4)
    cfg = RunnerConfig(device="cpu", dtype="float32", num_kv_slots=256, max_rows=4, aux_hidden_layers=(2, 0, 2))
    hf_config = {**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    runner = ModelRunner.from_hf_state_dict(hf_config, hf.state_dict(), cfg)
    assert runner.aux_hidden is not None
    ids = [5, 9, 13, 2, 7]
    run_step(runner, [(0, ids, 0, list(range(5)))])
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
    expected = torch.cat([states[i + 1][0] for i in (2, 0, 2)], -1)  # (the last entry is normed)
    torch.testing.assert_close(runner.aux_hidden.rows(5), expected, atol=1e-4, rtol=1e-4)
    plain = ModelRunner.from_hf_state_dict(hf_config, hf.state_dict(), dataclasses.replace(cfg, aux_hidden_layers=None))
    plain_model = cast(DecoderStack, plain.model).model
    assert plain.aux_hidden is None and plain_model.aux_hidden is None  # off: nothing
    assert plain_model.aux_readers == (None,) * 5  # a forward reads nothing per layer (made once, not per step)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(drop="layers.0.self_attn.q_proj.weight"), "lacks tensors: layer.self_attn.q_proj.weight"),
        (dict(config={"draft_vocab_size": 32}), "lm_head.weight has shape"),
        (dict(drop="d2t"), "no d2t tensor"),
    ],
)
def test_bad_heads_are_refused(tmp_path, change, message):
    from safetensors.torch import load_file, save_file

    folder = save_head(tmp_path / "bad", "speculators", random_head_tensors(), **change.get("config", {}))
    if "drop" in change:
        tensors = load_file(f"{folder}/model.safetensors")
        del tensors[change["drop"]]
        save_file(tensors, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_eagle3_head(folder, VOCAB, _embedding(), CPU, torch.float32)


def test_a_head_for_another_target_is_refused(tmp_path):
    config = Eagle3Config.from_folder(save_head(tmp_path / "h", "eagle", random_head_tensors()))
    other = ModelConfig.from_hf_dict(dict(TARGET, vocab_size=512, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match="vocabulary 256 != target vocabulary 512"):
        config.check_target(other)
    shallow = ModelConfig.from_hf_dict(dict(TARGET, num_hidden_layers=2, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match="must be 3 layers of the target's 2"):
        config.check_target(shallow)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Config.from_dict(dict(TARGET, architectures=["LlamaForCausalLM"]))


def test_drafting_together_gives_each_requests_own_drafts(heads):
    from tgi_compat.router.speculative.eagle3 import Eagle3Proposer, propose_together

    tensors, folders = heads
    embed = _embedding()
    head = load_eagle3_head(folders["eagle"], VOCAB, embed, CPU, torch.float32)
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 6)]
    proposers, aux = [], [torch.randn(len(t), 3 * TARGET["hidden_size"], generator=g) for t in sequences]
    for tokens, rows in zip(sequences, aux):
        proposers.append(proposer := Eagle3Proposer(head))
        proposer.extend(tokens)
        proposer.observe(0, rows)
    limits = [4, 2, 0]
    drafts = propose_together(head, proposers, limits)
    expected = [reference_drafts(tensors, embed, t, a, k) if k else [] for t, a, k in zip(sequences, aux, limits)]
    assert drafts == expected
    assert propose_together(head, proposers, limits) == [[], [], []]  # nothing new computed since


def test_the_heads_cost_is_measured_on_the_cpu_cheaply(heads):
    from tgi_compat.modeling.step_cost import HEAD_COST_BATCHES_CPU, measure_head_costs
    from tgi_compat.router.model_loading import measure_head_cost

    _, folders = heads
    head = load_eagle3_head(folders["eagle"], VOCAB, _embedding(), CPU, torch.float32)
    batches, fixed, per_draft = measure_head_costs(head, (1, 3), context=8, repeats=1)
    assert batches == (1, 3) and len(fixed) == len(per_draft) == 2
    assert all(0 < s < 1 for s in fixed + per_draft)
    cost = measure_head_cost(head)  # what the engine measures at startup
    assert cost.per_draft.rows == HEAD_COST_BATCHES_CPU
    assert cost.cost(2, 3) > cost.cost(2, 1) > cost.cost(2, 0) == 0.0
