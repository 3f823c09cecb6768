"""The transformers fallback under tensor parallelism on CPU (gloo, 2 ranks): families with no native file whose
transformers plan is Llama's (models/transformers_sharding.py) give one rank's logits and greedy choices, with
uneven splits (6 query heads over 3 KV heads: rank 0 holds 1 KV head, rank 1 2; 100 MLP rows; a vocabulary of 251),
and each rank's KV cache holds only its KV heads, the values one rank stores for them. Families whose plan is not
Llama's, or with a weight that splits with the heads outside it, refuse with their reason."""

from __future__ import annotations

import pytest
import torch
from transformers import CohereConfig, Exaone4Config, Olmo2Config, Starcoder2Config

from tests.modeling.helpers import max_rel_error, tiny_hf_model
from tests.modeling.llava_next_helpers import WIDE, processed, tiny_llava_next
from tests.modeling.test_tensor_parallel_logits import SHARDED_SIZES, TOLERANCE, _run_steps, _runner
from tests.modeling.tp_group import saved_models, sharded_results
from tgi_compat.kernels.sampling.greedy_pick import greedy_pick_ref
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import ImageEmbeds, build_forward_batch
from tgi_compat.modeling.models.transformers_fallback import TransformersForCausalLM
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, shard_heads
from tgi_compat.modeling.runner import ModelRunner

SIZES = {**SHARDED_SIZES, "vocab_size": 251}
CACHED_SLOTS = 18  # the slots _run_steps writes


def _save_starcoder2(folder: str, sizes: dict) -> None:
    # biases on q/k/v/o and the MLP (row-parallel ones added once), c_fc/c_proj as its MLP's names
    tiny_hf_model(Starcoder2Config, **sizes).save_pretrained(folder, max_shard_size="200KB")


def _save_exaone4(folder: str, sizes: dict) -> None:
    # q/k norms over head_dim, whole on every rank (its plan's "replicated_with_grad_allreduce")
    tiny_hf_model(Exaone4Config, **sizes).save_pretrained(folder)


def _save_llava_next(folder: str, sizes: dict) -> None:
    # a vision-language wrapper: its Llama text model shards under model.language_model, the CLIP tower stays whole
    text = {key: value for key, value in sizes.items() if key != "vocab_size"}
    tiny_llava_next(sizes["vocab_size"], **text).save_pretrained(folder)


# name -> its tiny checkpoint's writer (folder, sizes); tests/gpu/check_tp_families.py runs them on 2 GPUs too
MODELS = {"starcoder2": _save_starcoder2, "exaone4": _save_exaone4, "llava-next": _save_llava_next}


def _steps_and_cache(runner: ModelRunner) -> list[torch.Tensor]:
    """_run_steps' answers, then layer 0's keys in the slots they wrote (this rank's KV heads)."""
    return [*_run_steps(runner), runner.kv_caches[0][0][:CACHED_SLOTS].clone()]


def _image_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A prompt with an image (its rows from rank 0's whole vision tower, sent with the step), then a decode."""
    (rows,) = runner.model.encode_processed(dict(processed([WIDE])))
    ids = [5, 6, 7] + [SIZES["vocab_size"] - 1] * len(rows) + [10, 11]  # <image> is the top of the vocabulary
    n = len(ids)
    prefill = build_forward_batch(ids, [0], [n], [n], list(range(n)), list(range(n)), device="cpu")
    prefill.images = ImageEmbeds(torch.arange(3, 3 + len(rows)), rows, [[]])
    decode = build_forward_batch([12], [0], [1], [n + 1], [n], [0], device="cpu")
    return [runner.forward(prefill).clone(), runner.forward(decode).clone()]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[dict[str, str], dict[str, list[torch.Tensor]]]:
    """(model -> its folder, key -> rank 0's answers) from one group of 2 ranks that serves each model in turn (the
    key: its folder, or "image" for LLaVA-Next's image steps)."""
    folders = saved_models(tmp_path_factory, MODELS, SIZES, "fallback-tp")
    runs = {folder: (folder, _steps_and_cache) for folder in folders.values()}
    runs["image"] = (folders["llava-next"], _image_steps)
    path = str(tmp_path_factory.mktemp("fallback-tp") / "logits.pt")
    return folders, sharded_results(2, runs, _runner, path, images=True)


def _check_logits(sharded_steps: list[torch.Tensor], one_rank_steps: list[torch.Tensor]) -> None:
    for ours, ref in zip(sharded_steps, one_rank_steps, strict=True):
        assert ours.shape == ref.shape
        assert max_rel_error(ours, ref) <= TOLERANCE


@pytest.mark.parametrize("model", list(MODELS))
def test_sharded_fallback_equals_one_rank(model, served):
    folders, sharded = served
    *ours_steps, ours_greedy, ours_keys = sharded[folders[model]]
    *ref_steps, ref_greedy_logits, ref_keys = _steps_and_cache(_runner(folders[model], NO_TP))
    _check_logits(ours_steps, ref_steps)
    ref_ids, ref_packed = greedy_pick_ref(ref_greedy_logits)
    assert ours_greedy[0].long().tolist() == ref_ids.tolist()
    torch.testing.assert_close(ours_greedy[1], ref_packed[1], rtol=0, atol=1e-4)
    # rank 0's cache holds its KV heads only, as one rank stores them
    kv = shard_heads(SIZES["num_attention_heads"], SIZES["num_key_value_heads"], TensorParallel(0, 2)).kv_heads
    assert ours_keys.shape[1] == kv.size < ref_keys.shape[1]
    torch.testing.assert_close(ours_keys, ref_keys[:, kv.start : kv.end], rtol=0, atol=1e-5)


def test_sharded_llava_next_with_an_image_equals_one_rank(served):
    folders, sharded = served
    _check_logits(sharded["image"], _image_steps(_runner(folders["llava-next"], NO_TP)))


@pytest.mark.parametrize(
    ("config_cls", "overrides", "reason"),
    [
        # OLMo-2 norms q and k over all heads: transformers gathers them (colwise_gather_output)
        (Olmo2Config, {}, "olmo2's plan shards layers.*q_proj as 'colwise_gather_output', not 'colwise'"),
        # Cohere's per-head q/k norm weights split with the heads, which its plan does not say
        (CohereConfig, {"use_qk_norm": True}, r"q_norm.weight is \[6, 16\] in the checkpoint and \[2, 16\] at this"),
    ],
    ids=["olmo2", "cohere-qk-norm"],
)
def test_what_the_fallback_cannot_split_refuses_with_its_reason(config_cls, overrides, reason):
    model = tiny_hf_model(config_cls, **SIZES, **overrides)
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    with pytest.raises(ValueError, match=reason):
        TransformersForCausalLM(ModelConfig.from_hf_dict(config), tp=TensorParallel(0, 2))
