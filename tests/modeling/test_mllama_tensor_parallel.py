"""Mllama under tensor parallelism on CPU (gloo, 2 ranks; tests/modeling/mllama_helpers.py's tiny model: 4 query
heads over 2 KV heads, one of each rank's): a request with an image (TALL: 3 real tiles and a padding one; text
before it reads every key with its MLP output dropped) beside a text-only request, then a decode of both, then the
image request's keys dropped as another image request starts, give one rank's logits and greedy ids. Rank 0's
image keys, made by the engine's store (router/cross_attention.py), hold its KV head only, one rank's values for
it; the other rank makes its own from the vision states sent with the step (parallel/cross_broadcast.py). The real
engine at --num-shard 2 gives transformers' ids, its store and KV pool empty after."""

from __future__ import annotations

import pytest
import torch

from benchmarks.device.steps import engine_tokens
from tests.benchmarks.conftest import free_port
from tests.modeling import mllama_helpers as mllama
from tests.modeling.helpers import max_rel_error
from tests.modeling.test_tensor_parallel_logits import TOLERANCE, _runner
from tests.modeling.tp_group import sharded_results
from tests.router.sharded_engine import sharded_engine
from tgi_compat.kernels.sampling.greedy_pick import greedy_pick_ref
from tgi_compat.modeling.forward_batch import ForwardBatch, build_forward_batch
from tgi_compat.modeling.models.mllama import MllamaForConditionalGeneration
from tgi_compat.modeling.models.transformers_fallback import fallback_model_config
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, shard_heads
from tgi_compat.modeling.runner import ModelRunner
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.cross_attention import CrossAttentionStore
from tgi_compat.router.image_cache import EncoderCache
from tgi_compat.router.request import Request

ARCHITECTURE = "MllamaForConditionalGeneration"
LOGITS = mllama.VOCAB - 1  # the text model's vocabulary; the ids past it (`<|image|>`'s 8) are -inf


def _request(request_id: str, ids: list[int], images: list[bytes]) -> Request:
    return Request(mllama.engine_request(request_id, ids, images), arrival=0)


def image_steps(runner: ModelRunner, greedy: bool = True) -> list[torch.Tensor]:
    """Each step's logits over the text vocabulary (sharded: gathered; the ids past it checked -inf), with `greedy`
    the decode again as a greedy-only step, then rank 0's image keys of the first cross layer (also run on 2 GPUs
    by tests/gpu/check_tp_families.py)."""
    assert runner.image_encoder is not None and runner.cross_attention is not None
    store = CrossAttentionStore(EncoderCache(runner.image_encoder), runner.cross_attention.projector)
    device = torch.device(runner.device)
    image, text = _request("image", mllama.ONE, [mllama.TALL]), _request("text", mllama.TEXT, [])
    image.row, text.row = 0, 1
    a, b = len(mllama.ONE), len(mllama.TEXT)
    prefill = build_forward_batch(
        mllama.ONE + mllama.TEXT, [0, 1], [a, b], [a, b], list(range(a + b)), list(range(a + b)), device=device
    )
    prefill.cross = store.step([(0, 0, a, image), (a, 0, b, text)], device)
    assert prefill.cross is not None
    keys = prefill.cross.runs[0].kv[0][0].cpu().clone()

    def decode() -> ForwardBatch:
        batch = build_forward_batch([11, 12], [0, 1], [1, 1], [a + 1, b + 1], [a + b, a + b + 1], [0, 1], device=device)
        batch.cross = store.step([(0, a, a + 1, image), (1, b, b + 1, text)], device)
        return batch

    outputs = [_text_logits(runner.forward(prefill)), _text_logits(runner.forward(decode()))]
    if greedy:
        batch = decode()
        batch.greedy_only = True
        answer = runner.forward(batch)
        outputs.append(answer.cpu().clone() if isinstance(answer, torch.Tensor) else answer.packed.cpu().clone())
    # the image request ends; a new one's first step drops its keys on every rank and makes the new ones
    other = _request("other", mllama.ONE, [mllama.WIDE])
    image.row, other.row = None, 0
    slots = list(range(a + b + 2, 2 * a + b + 2))
    again = build_forward_batch(mllama.ONE, [0], [a], [a], slots, [a - 1], device=device)
    again.cross = store.step([(0, 0, a, other)], device)
    assert again.cross is not None and again.cross.held == [1] and len(store) == 1
    outputs.append(_text_logits(runner.forward(again)))
    return [*outputs, keys]


def _text_logits(logits: torch.Tensor) -> torch.Tensor:
    assert logits[:, LOGITS:].isneginf().all()  # `<|image|>` and the ids past it: never sampled
    return logits[:, :LOGITS].cpu().clone()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[object, str]:
    """(transformers' tiny Mllama, its folder): saved under the hub's names (`language_model.model.*`), which each
    rank reads its slices of through transformers' renamings (one rank: transformers reads the folder)."""
    return mllama.saved_mllama(tmp_path_factory.mktemp("mllama-tp"))


def test_image_keys_per_rank_are_its_kv_heads():
    """The room the runner keeps per image (CrossAttentionKeys) is a rank's: its share of the KV heads."""
    config = fallback_model_config({**mllama.tiny_mllama().config.to_dict(), "architectures": [ARCHITECTURE]})
    one_rank = MllamaForConditionalGeneration(config).image_kv_bytes
    assert MllamaForConditionalGeneration(config, tp=TensorParallel(1, 2)).image_kv_bytes == one_rank // 2


def test_sharded_mllama_equals_one_rank(checkpoint, tmp_path):
    _, folder = checkpoint
    *ours, ours_greedy, ours_again, ours_keys = sharded_results(
        2, {"mllama": (folder, image_steps)}, _runner, str(tmp_path / "logits.pt")
    )["mllama"]
    *ref, ref_greedy, ref_again, ref_keys = image_steps(_runner(folder, NO_TP))
    for sharded, one_rank in zip([*ours, ours_again], [*ref, ref_again], strict=True):
        assert sharded.shape == one_rank.shape
        assert max_rel_error(sharded, one_rank) <= TOLERANCE
    # the greedy choice over the text vocabulary (the -inf ids past it change no id or log-probability)
    ids, packed = greedy_pick_ref(ref_greedy)
    assert ours_greedy[0].long().tolist() == ids.tolist()
    torch.testing.assert_close(ours_greedy[1], packed[1], rtol=0, atol=1e-4)
    # rank 0's image keys [keys, its KV heads, head_dim]: its one KV head of the two, as one rank makes it
    kv = shard_heads(4, 2, TensorParallel(0, 2)).kv_heads
    assert ours_keys.shape[1] == kv.size == 1 < ref_keys.shape[1]
    torch.testing.assert_close(ours_keys, ref_keys[:, kv.start : kv.end], rtol=0, atol=1e-5)


def test_sharded_engine_gives_transformers_ids(checkpoint):
    """The real engine at --num-shard 2 (rank 1 the server's own worker) under 4-token prefill chunks: three images
    (two back to back, one with a padding tile) beside a text request, then another image request once their keys
    are dropped, each give transformers' `generate` ids alone; the store and the KV pool are empty after."""
    model, folder = checkpoint
    config = EngineConfig(
        model_id=folder, device="cpu", dtype="float32", max_batch_prefill_tokens=4, num_shard=2, master_port=free_port()
    )
    with sharded_engine(config) as engine:
        mllama.check_images_beside_text(model, lambda requests: engine_tokens(engine, requests))
        out = engine_tokens(engine, [mllama.engine_request("one", mllama.ONE, [mllama.WIDE])])
        assert out["one"] == mllama.generate_ids(model, mllama.ONE, [mllama.WIDE], mllama.NEW)
        assert engine.cross_attention is not None and len(engine.cross_attention) == 0
        assert engine.pool.is_full_free()
