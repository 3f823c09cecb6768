"""A Gemma 2 runner (sliding window on alternate layers, soft-capped attention logits) on the Triton
backend gives the torch backend's logits over extend, mixed and decode steps, past the window; Gemma 2/3
on the Triton layer ops (sandwich norms fused) give transformers' logits."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.test_triton_backend import make_runner, run_steps
from tgi_compat.kernels.gemv.types import PROLOGUE_NORM_ADD_NORM, GemvConfig


def test_triton_backend_windowed_soft_capped_model_matches_torch_backend():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.modeling.helpers import TINY_SIZES

    config = Gemma2Config(  # half the usual width: the kernels run interpreted
        **TINY_SIZES
        | dict(hidden_size=32, intermediate_size=64, max_position_embeddings=128, vocab_size=97)
        | dict(tie_word_embeddings=True),  # Gemma's own head
        head_dim=16,
        sliding_window=4,  # the steps reach 10 tokens
        attn_logit_softcapping=1.0,
        final_logit_softcapping=5.0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    weights = ({**config.to_dict(), "architectures": ["Gemma2ForCausalLM"]}, model.state_dict())
    for expected, got in zip(run_steps(make_runner(weights, "torch")), run_steps(make_runner(weights, "triton"))):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_triton_layer_ops_fuse_the_sandwich_norms_and_keep_transformers_logits(case: str, monkeypatch):
    """Gemma 2/3 on the Triton layer ops (interpreted; Gemma 3's q/k norms in one kernel): the prompt's chunks
    through the norm-add-norm kernel, then one-row decode steps through the GEMVs' NORM_ADD_NORM prologue (the
    GEMV is allowed on CPU here), within 1e-4 of transformers in fp32, past the sliding window."""
    import tgi_compat.modeling.runner
    from tests.modeling.helpers import hf_logits, max_rel_error, run_step, tiny_runner
    from tests.modeling.test_gemma_parity import CASES, prompt

    triton_ops = sys.modules["tgi_compat.modeling.layers.triton_ops"]  # the interpreted module tests/kernels loaded
    fused_calls = []

    def gemv_on_cpu_too(x, weight, prologue):
        if x.shape[0] != 1 or not isinstance(weight, torch.Tensor):
            return None
        if prologue == PROLOGUE_NORM_ADD_NORM:
            fused_calls.append(prologue)
        return GemvConfig(block_n=64, block_k=32, num_warps=1)  # few programs: the interpreter is slow

    norm_launches = []

    def counted_rmsnorm(*args, **kwargs):
        norm_launches.append(1)
        return rmsnorm(*args, **kwargs)

    rmsnorm = triton_ops.rmsnorm
    monkeypatch.setattr(tgi_compat.modeling.runner, "select_ops", lambda device: triton_ops.TRITON_OPS)
    monkeypatch.setattr(triton_ops, "gemv_config_for", gemv_on_cpu_too)
    monkeypatch.setattr(triton_ops, "rmsnorm", counted_rmsnorm)
    config_cls, overrides = CASES[case]
    model, runner = tiny_runner(config_cls, tie_word_embeddings=True, **overrides)
    ids = prompt(model.config.vocab_size, 14)  # the window is 8
    ref = hf_logits(model, ids)
    slots = list(range(100, 114))
    (first,) = run_step(runner, [(1, ids[:12], 0, slots[:12])])
    norm_launches.clear()
    decodes = [run_step(runner, [(1, [ids[p]], p, [slots[p]])])[0] for p in range(12, 14)]
    assert max_rel_error(torch.cat([first, *decodes]), ref) <= 1e-4
    # per decode step: one per layer after the first (its input norm) and one per layer (the pre-MLP norm)
    layers = model.config.num_hidden_layers
    assert len(fused_calls) == 2 * (2 * layers - 1)
    # and no norm kernel of a layer's own: only the last layer's post-MLP norm and the final norm, once a step
    assert len(norm_launches) == 2 * 2
