"""A Llama 4 text model (local layers in chunks of 4 tokens, a global NoPE layer) through the transformers fallback on
the Triton backend gives the torch backend's logits over extend, mixed and decode steps that cross chunk edges."""

from __future__ import annotations

import torch

from tests.kernels.test_triton_backend import make_runner, run_steps


def test_triton_backend_chunked_model_matches_torch_backend():
    from transformers import Llama4ForCausalLM

    from tests.modeling.helpers import randomize
    from tests.modeling.llama4_helpers import tiny_llama4_text_config

    config = tiny_llama4_text_config(attention_chunk_size=4)  # the steps reach 10 tokens: three chunks
    model = randomize(Llama4ForCausalLM(config))
    weights = ({**config.to_dict(), "architectures": ["Llama4ForCausalLM"]}, model.state_dict())
    for expected, got in zip(run_steps(make_runner(weights, "torch")), run_steps(make_runner(weights, "triton"))):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
