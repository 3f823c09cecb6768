"""EAGLE-3 speculation in the engine: a tiny random head over a tiny random 4-layer Llama drafts through the real
scheduler, executor, runner (auxiliary hidden states on) and sampler; the output must be `--speculate 0`'s, token
for token, and the KV pool full again. Prefill chunks of 16 tokens make requests hand over hidden states in parts."""

from __future__ import annotations

import dataclasses

import pytest

from tests.modeling.eagle3_heads import DRAFT_VOCAB, TARGET, random_head_tensors, save_head
from tests.router.sharded_engine import generate, sharded_engine
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.request import SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig
from tgi_compat.router.speculative.policy import HeadCost, StepCostTable, drafts_may_pay
from tgi_compat.router.speculative.speculator import Speculator
from tgi_compat.router.speculative.synthetic import SyntheticAcceptance

SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=7),
}
LIMITS = dict(max_batch_total_tokens=2048, max_running_requests=8, max_batch_prefill_tokens=16)
PROMPTS = [[1 + (i * 37 + j * 11) % 250 for j in range(3 + 13 * i)] for i in range(4)]  # 3..42 tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("eagle3-engine")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TARGET, bos_token_id=1, eos_token_id=2)).save_pretrained(root / "target")
    # the draft vocabulary covers a quarter of the target's: d2t maps draft i to target 4 * i
    tensors = random_head_tensors(seed=1) | {"d2t": torch.arange(DRAFT_VOCAB) * 3}
    return str(root / "target"), save_head(root / "head", "speculators", tensors)


def _engine(target: str, speculative: SpeculativeConfig | None):
    from tgi_compat.router.engine import EngineCore

    config = EngineConfig(model_id=target, speculative=speculative, **LIMITS)
    return EngineCore.from_config(config)


def _run(engine, sampling: SamplingParams, together: bool) -> dict[str, list[int]]:
    """Every prompt in one batch, or every other one alone; the KV pool is full again after each (generate)."""
    pairs = list(enumerate(PROMPTS))
    out: dict[str, list[int]] = {}
    for batch in [pairs] if together else [[pair] for pair in pairs[1::2]]:
        out |= generate(engine, dict(batch), sampling, max_new_tokens=20)
    return out


@pytest.fixture(scope="module")
def engines(folders):
    target, head = folders
    eagle = SpeculativeConfig(num_speculative_tokens=3, method="eagle3", draft_model=head)
    return _engine(target, None), _engine(target, eagle)


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_eagle3_gives_the_tokens_of_speculate_0(engines, sampling):
    plain, eagle = engines
    expected = _run(plain, SAMPLINGS[sampling], together=True)
    counters = eagle.scheduler.speculator.counters
    drafted = counters.num_draft_tokens
    assert _run(eagle, SAMPLINGS[sampling], together=True) == expected
    alone = _run(eagle, SAMPLINGS[sampling], together=False)
    assert alone == {rid: expected[rid] for rid in alone}
    assert counters.num_draft_tokens > drafted  # the head drafted


def test_the_heads_cost_turns_its_drafts_off_where_the_step_table_alone_drafts(engines):
    plain, eagle = engines
    speculator = eagle.scheduler.speculator
    assert isinstance(speculator.head_cost, HeadCost)  # measured at startup (CPU: a few small batches)
    expected = _run(plain, SAMPLINGS["greedy"], together=True)
    config, measured = speculator.config, speculator.head_cost
    flat = StepCostTable(rows=(1, 512), seconds=(1.0, 1.001))  # verify rows for free: drafts pay (the head too)
    try:
        speculator.config = dataclasses.replace(config, step_cost=flat)
        counters = speculator.counters
        drafted = counters.num_draft_tokens
        assert _run(eagle, SAMPLINGS["greedy"], together=True) == expected
        assert counters.num_draft_tokens > drafted
        speculator.head_cost = HeadCost(StepCostTable((1, 8), (5.0, 5.0)), StepCostTable((1, 8), (5.0, 5.0)))
        drafted = counters.num_draft_tokens  # a head slower than a step: no drafting step pays
        assert _run(eagle, SAMPLINGS["greedy"], together=True) == expected
        assert counters.num_draft_tokens == drafted
    finally:
        speculator.config, speculator.head_cost = config, measured


@pytest.mark.parametrize("uniform", [0, 8], ids=["per-request", "uniform"])
def test_a_head_that_pays_only_at_a_high_acceptance_starts_drafting_and_keeps_on(engines, uniform):
    """A head too slow for a 0.5 acceptance to pay, fast enough for 0.9, with 0.9 accepted (synthetic): the first
    steps explore (drafts under the optimistic rate), and from then on the learned estimate keeps drafting on,
    for the next requests too. (With a fixed 0.5 prior no request ever drafted.)"""
    from tests.router.test_spec_policy import H200_LIKE

    _, eagle = engines
    scheduler, original = eagle.scheduler, eagle.scheduler.speculator
    geometric = SyntheticAcceptance((0.1, 0.09, 0.081, 0.729))  # each of 3 drafts accepted with p = 0.9
    config = dataclasses.replace(
        original.config, step_cost=H200_LIKE, synthetic_acceptance=geometric, uniform_max_batch=uniform
    )
    speculator = Speculator(config, original.drafter)
    flat = StepCostTable((1, 64), (2e-3, 2e-3))
    speculator.head_cost = HeadCost(fixed=flat, per_draft=StepCostTable((1, 64), (1.5e-3, 1.5e-3)))
    for batch in (1, 4):
        assert not drafts_may_pay(batch, 0.5, 3, H200_LIKE, speculator.head_cost)
        assert drafts_may_pay(batch, 0.85, 3, H200_LIKE, speculator.head_cost)
    try:
        scheduler.speculator = speculator
        counters, estimate = speculator.counters, speculator.estimate
        generate(eagle, dict(enumerate(PROMPTS)), SAMPLINGS["greedy"], max_new_tokens=24)
        assert counters.num_drafts > 0 and estimate.rate > 0.8
        explored, drafts = estimate.num_explored, counters.num_drafts
        generate(eagle, {9: PROMPTS[1]}, SAMPLINGS["greedy"], max_new_tokens=24)  # a newcomer, alone
        assert counters.num_drafts - drafts >= 4 and estimate.num_explored == explored  # drafts from the estimate
    finally:
        scheduler.speculator = original


def test_eagle3_under_tensor_parallelism_gives_the_tokens_of_one_rank(folders, engines):
    """--num-shard 2 on gloo: rank 0 (this process) drafts with the head; rank 1, the server's own worker (spawned),
    follows the step plan. Greedy and seeded token ids are one rank's `--speculate 0`, and the KV pool (rank 0's:
    the other ranks keep none) is full again after each batch. The drafts are one rank's head's too (as many
    drafted and accepted): the head reads whole hidden states and a whole embedding on rank 0."""
    from tests.benchmarks.conftest import free_port

    (target, head), (plain, _) = folders, engines
    eagle = SpeculativeConfig(num_speculative_tokens=3, method="eagle3", draft_model=head)
    config = EngineConfig(model_id=target, speculative=eagle, num_shard=2, master_port=free_port(), **LIMITS)
    with sharded_engine(config) as engine:
        for name, sampling in SAMPLINGS.items():
            assert _run(engine, sampling, together=True) == _run(plain, sampling, together=True), name
        single = _engine(target, eagle)  # (fresh: its prefix cache holds what the sharded one's does)
        for sampling in SAMPLINGS.values():
            _run(single, sampling, together=True)
        ours = engine.scheduler.speculator.counters
        assert ours.num_accepted_tokens > 0
        assert ours == single.scheduler.speculator.counters


def test_a_sharded_engine_leaves_room_for_the_whole_embedding_a_head_borrows(folders, tmp_path):
    import torch

    from tgi_compat.router.model_loading import _draft_model_bytes

    target, head = folders
    own = random_head_tensors() | {"embed_tokens.weight": torch.zeros(TARGET["vocab_size"], TARGET["hidden_size"])}
    heads = {"borrows": head, "own": save_head(tmp_path / "own", "speculators", own)}
    reserved = {
        (name, shards): _draft_model_bytes(
            EngineConfig(
                model_id=target, speculative=SpeculativeConfig(2, method="eagle3", draft_model=path), num_shard=shards
            )
        )
        for name, path in heads.items()
        for shards in (1, 2)
    }
    embedding = TARGET["vocab_size"] * TARGET["hidden_size"] * 4  # float32 on the CPU
    assert reserved["borrows", 2] == reserved["borrows", 1] + embedding  # rank 0's own is a vocabulary block
    assert reserved["own", 2] == reserved["own", 1] > embedding  # (its embedding is in its checkpoint's size)


def _launch(*argv: str):
    from tgi_compat.api.cli.launcher import config_from_args, parse_args

    return config_from_args(parse_args(list(argv)))


def test_tgi_model_id_of_a_head_serves_the_base_model_it_names(folders, engines, tmp_path):
    target, _ = folders
    verifier = {"algorithm": "eagle3", "verifier": {"name_or_path": target}}
    head = save_head(tmp_path / "head", "speculators", random_head_tensors(seed=1), speculators_config=verifier)
    config = _launch("--model-id", head, "--speculate", "3")
    assert config.model_id == target  # the tokenizer, chat template and /info are the base model's, as in TGI
    spec = config.speculative
    assert spec is not None and (spec.method, spec.draft_model, spec.num_speculative_tokens) == ("eagle3", head, 3)
    engine_config = config.to_engine_config()
    for name, value in LIMITS.items():
        setattr(engine_config, name, value)
    from tgi_compat.router.engine import EngineCore

    served = EngineCore.from_config(engine_config)
    assert served.scheduler.speculator.drafter is not None
    plain, _ = engines
    assert _run(served, SAMPLINGS["greedy"], together=True) == _run(plain, SAMPLINGS["greedy"], together=True)
    # an EAGLE-format head with Medusa's key; without --speculate, a default chain length
    eagle = save_head(tmp_path / "eagle", "eagle", random_head_tensors(), base_model_name_or_path=target)
    spec = _launch("--model-id", eagle).speculative
    assert spec is not None and (spec.draft_model, spec.num_speculative_tokens) == (eagle, 3)
    assert _launch("--model-id", target).speculative is None  # a plain model is no head


def test_a_head_whose_base_model_cannot_be_found_stops_the_launcher(tmp_path):
    from tgi_compat.api.cli.launcher import LauncherError

    missing = {"verifier": {"name_or_path": str(tmp_path / "no-such-model")}}
    head = save_head(tmp_path / "head", "speculators", random_head_tensors(), speculators_config=missing)
    with pytest.raises(LauncherError, match="EAGLE-3 head for base model .*no-such-model.* not found"):
        _launch("--model-id", head, "--speculate", "2")
    orphan = save_head(tmp_path / "orphan", "eagle", random_head_tensors())
    with pytest.raises(LauncherError, match="names no base model"):
        _launch("--model-id", orphan)


def test_eagle3_from_the_vllm_flag(folders):
    _, head = folders
    spec = SpeculativeConfig.from_vllm_json(f'{{"method": "eagle3", "model": "{head}", "num_speculative_tokens": 2}}')
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens) == ("eagle3", head, 2)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_vllm_json('{"method": "eagle3", "num_speculative_tokens": 2}')


def test_a_head_for_another_target_stops_the_engine(folders, tmp_path):
    target, _ = folders
    wrong = save_head(tmp_path / "wrong", "eagle", random_head_tensors(), vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary 512 != target vocabulary 256"):
        _engine(target, SpeculativeConfig(num_speculative_tokens=2, method="eagle3", draft_model=wrong))
