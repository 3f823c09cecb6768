"""Tensor parallelism on CPU (gloo): N ranks under torch.multiprocessing give TP=1's logits.

Rank 0 drives the steps through ModelRunner.forward, which broadcasts each batch; the other ranks
follow (ModelRunner.follow_rank_zero). The ranks load from disk, each reading only its slice
(GGUF rows, safetensors get_slice). One group of N ranks runs every model in turn (starting
processes, not the tiny models, is what costs time): the embedded SmolLM2 and a tiny random
checkpoint of each sharded family. Also: how heads and vocabulary split.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from tests.modeling.helpers import max_rel_error, tiny_hf_model
from tests.modeling.test_gemma_parity import CASES as GEMMA_CASES
from tests.modeling.test_moe_parity import CASES as MOE_CASES
from tests.modeling.tp_group import sharded_results
from tgi_compat.kernels.sampling.greedy_pick import greedy_pick_ref
from tgi_compat.modeling.forward_batch import PrefixGroups, build_forward_batch
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, shard_heads, vocab_shard
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

PROMPTS = [[1, 17, 300, 4021, 9, 77, 15000], [2, 5000, 42, 31000, 8]]
TOLERANCE = 1e-4  # fp32, relative to the largest logit: only the order of the sums differs
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # 9 query heads, 3 KV heads: 3 ranks split evenly, 2 split 6 + 3
# 6 query heads over 3 KV heads (2 ranks: 4 + 2 query heads), intermediate sizes and a vocabulary
# that do not divide by 2 or 3: every split is uneven somewhere.
SHARDED_SIZES = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=100)
TINY_FAMILIES = {
    **{name: (cls, {**overrides, "tie_word_embeddings": True}) for name, (cls, overrides) in GEMMA_CASES.items()},
    "phi3": (Phi3Config, {"pad_token_id": 0}),  # q|k|v and gate|up fused in the checkpoint
    **{name: (cls, {**overrides, "moe_intermediate_size": 40}) for name, (cls, overrides) in MOE_CASES.items()},
    # q/k/v/o and MLP biases (row-parallel biases added once), 2 KV heads (over 3 ranks: one held by
    # two ranks, which split its query heads 1 + 2), weights in several safetensors files
    "llama-biases": (
        LlamaConfig,
        dict(vocab_size=251, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    ),
}
CASES = [(SMOLLM2, 3), (SMOLLM2, 2)] + [(family, size) for family in TINY_FAMILIES for size in (2, 3)]


def _steps() -> list[dict]:
    """A two-request prefill, a decode step, then a mixed step (a new prompt beside a decode)."""
    a, b = PROMPTS
    return [
        dict(input_ids=a + b, req_rows=[0, 1], q_lens=[7, 5], kv_lens=[7, 5], out_slots=list(range(12)),
             logits_indices=list(range(12))),
        dict(input_ids=[11, 12], req_rows=[0, 1], q_lens=[1, 1], kv_lens=[8, 6], out_slots=[12, 13],
             logits_indices=[0, 1]),
        dict(input_ids=[13, 3, 4, 5], req_rows=[0, 2], q_lens=[1, 3], kv_lens=[9, 3], out_slots=[14, 15, 16, 17],
             logits_indices=[0, 1, 2, 3]),
    ]  # fmt: skip


def _run_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """The logits of every step, then the decode step again as a greedy-only step: what the runner answers (one rank:
    its logits; sharded: the greedy choice, ids then logprobs, [2, R])."""
    outputs = []
    for step in _steps():
        step = dict(step, input_ids=[i % runner.vocab_size for i in step["input_ids"]])
        outputs.append(runner.forward(build_forward_batch(device="cpu", **step)).clone())
    decode = _steps()[1]  # writes the same K/V to the same slots again: its logits do not change
    batch = build_forward_batch(
        device="cpu", **dict(decode, input_ids=[i % runner.vocab_size for i in decode["input_ids"]])
    )
    batch.greedy_only = True
    # a --diverse_mode table travels to the other ranks (the torch backend reads both rows' own slots either way)
    batch.prefix_groups = PrefixGroups(torch.tensor(PrefixGroups.rows([(5, [0, 1])], 2, 8)))
    answer = runner.forward(batch)
    outputs.append(answer.clone() if isinstance(answer, torch.Tensor) else answer.packed.clone())
    return outputs


def _runner(model_id: str, tp: TensorParallel) -> ModelRunner:
    cfg = RunnerConfig(model_id=model_id, device="cpu", dtype="float32", num_kv_slots=64, max_rows=4)
    cfg.show_progress = False
    return ModelRunner(cfg, tp=tp)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """family -> folder of its tiny random checkpoint (SmolLM2: the embedded GGUF)."""
    folders = {SMOLLM2: SMOLLM2}
    for family, (config_cls, overrides) in TINY_FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        tiny_hf_model(config_cls, **{**SHARDED_SIZES, **overrides}).save_pretrained(folder, max_shard_size="200KB")
        folders[family] = str(folder)
    return folders


@pytest.fixture(scope="module")
def sharded_logits(checkpoints, tmp_path_factory):
    """size -> {folder: logits of every step}: one group of `size` processes per size, run on demand."""

    @functools.cache
    def run(size: int) -> dict[str, list[torch.Tensor]]:
        runs = {model_id: (model_id, _run_steps) for model_id in checkpoints.values()}
        return sharded_results(size, runs, _runner, str(tmp_path_factory.mktemp(f"tp{size}") / "logits.pt"))

    return run


@functools.cache
def _one_rank_logits(folder: str) -> list[torch.Tensor]:
    return _run_steps(_runner(folder, NO_TP))


@pytest.mark.parametrize(("model", "size"), CASES)
def test_sharded_logits_equal_one_rank(model, size, checkpoints, sharded_logits):
    folder = checkpoints[model]
    *ours_steps, ours_greedy = sharded_logits(size)[folder]
    *ref_steps, ref_greedy_logits = _one_rank_logits(folder)
    for ours, ref in zip(ours_steps, ref_steps, strict=True):
        assert ours.shape == ref.shape
        assert max_rel_error(ours, ref) <= TOLERANCE
    # a greedy-only step: the sharded runner answers with the choice, from its ranks' vocabulary blocks (never
    # gathered), equal to the choice from one rank's whole logits
    ref_ids, ref_packed = greedy_pick_ref(ref_greedy_logits)
    assert ours_greedy.shape == (2, ref_ids.shape[0])
    assert ours_greedy[0].long().tolist() == ref_ids.tolist()
    torch.testing.assert_close(ours_greedy[1], ref_packed[1], rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "size"), [(9, 3, 2), (9, 3, 3), (32, 8, 4), (64, 8, 16), (4, 1, 2), (12, 2, 3)]
)
def test_every_query_head_lands_on_exactly_one_rank_with_its_kv_head(num_heads, num_kv_heads, size):
    group = num_heads // num_kv_heads
    owners = []
    for rank in range(size):
        shard = shard_heads(num_heads, num_kv_heads, TensorParallel(rank, size))
        heads = range(shard.q_heads.start, shard.q_heads.end)
        kv_heads = range(shard.kv_heads.start, shard.kv_heads.end)
        assert shard.num_heads >= 1 and all(h // group in kv_heads for h in heads)
        assert shard.num_heads == group * shard.num_kv_heads or shard.num_kv_heads == 1
        owners += heads
    assert sorted(owners) == list(range(num_heads))


def test_vocab_shards_are_equal_and_cover_the_vocabulary():
    shards = [vocab_shard(251, TensorParallel(rank, 3)) for rank in range(3)]
    assert {padded for _, padded in shards} == {84}
    assert [(rows.start, rows.size) for rows, _ in shards] == [(0, 84), (84, 84), (168, 83)]


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_expert_slices_of_the_ranks_tile_every_expert(stacked):
    """Each rank's gate, up and down slices, from per-expert checkpoint tensors or transformers 5's
    stacked ones, put back together are the experts (10 intermediate rows over 3 ranks: 3 + 3 + 4)."""
    from tgi_compat.modeling.layers.moe import FusedExperts

    num_experts, hidden, inter = 3, 8, 10
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden), torch.randn(num_experts, hidden, inter)
    ranks = [FusedExperts(num_experts, hidden, inter, TensorParallel(rank, 3)) for rank in range(3)]
    for experts in ranks:
        if stacked:
            experts.w13.weight_loader(experts.w13, w13, None)
            experts.w2.weight_loader(experts.w2, w2, None)
            continue
        for e in range(num_experts):
            experts.w13.weight_loader(experts.w13, w13[e, :inter], (e, "gate"))
            experts.w13.weight_loader(experts.w13, w13[e, inter:], (e, "up"))
            experts.w2.weight_loader(experts.w2, w2[e], (e, "down"))
    gate = torch.cat([experts.w13[:, : experts.intermediate_size] for experts in ranks], dim=1)
    up = torch.cat([experts.w13[:, experts.intermediate_size :] for experts in ranks], dim=1)
    assert [experts.intermediate_size for experts in ranks] == [3, 3, 4]
    assert torch.equal(torch.cat([gate, up], dim=1), w13)
    assert torch.equal(torch.cat([experts.w2 for experts in ranks], dim=2), w2)


def test_gguf_slices_read_only_their_part_and_equal_the_whole():
    from tests.modeling.helpers import smollm2_gguf_path
    from tgi_compat.modeling.weights.gguf import iterate_gguf, open_gguf

    layer = "model.layers.0."
    wanted = {  # name: (the dimension sliced, its start, its size)
        layer + "self_attn.q_proj.weight": (0, 128, 192),
        layer + "self_attn.k_proj.weight": (0, 64, 64),
        layer + "self_attn.o_proj.weight": (1, 384, 192),
        layer + "mlp.down_proj.weight": (1, 512, 1024),
        "model.embed_tokens.weight": (0, 16384, 16384),
    }
    checked = 0
    for name, lazy in iterate_gguf(open_gguf(smollm2_gguf_path()), 9, 3, show_progress=False, lazy=True):
        if name in wanted:
            dim, start, length = wanted[name]
            assert torch.equal(lazy.narrow(dim, start, length), lazy.materialize().narrow(dim, start, length))
            checked += 1
    assert checked == len(wanted)
