"""A Gemma 2 runner (sliding window on alternate layers, soft-capped attention logits) on the Triton
backend gives the torch backend's logits over extend, mixed and decode steps, past the window."""

from __future__ import annotations

import torch

from tests.kernels.test_triton_backend import make_runner, run_steps


def test_triton_backend_windowed_soft_capped_model_matches_torch_backend():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=97,
        max_position_embeddings=128,
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
