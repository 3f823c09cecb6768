"""A tiny random Llama 4 text model: local layers attending within chunks of CHUNK tokens, shorter than the tests'
prompts, one global NoPE layer whose queries' temperature grows every FLOOR positions, MoE on alternate layers."""

from __future__ import annotations

from typing import Any

from tests.modeling.helpers import TINY_SIZES, randomize

CHUNK = 8
FLOOR = 4  # the checkpoints' 8192 leaves a short prompt's queries unscaled


def tiny_llama4_text_config(**overrides: Any):
    from transformers import Llama4TextConfig

    sizes = {**TINY_SIZES, "num_hidden_layers": 4, "intermediate_size": 64, "intermediate_size_mlp": 128}
    shape = dict(head_dim=16, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2)
    switches = dict(attention_chunk_size=CHUNK, floor_scale=FLOOR, attn_scale=0.5)
    return Llama4TextConfig(**sizes, **shape, **switches | overrides, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_llama4_text(seed: int = 0):
    from transformers import Llama4ForCausalLM

    return randomize(Llama4ForCausalLM(tiny_llama4_text_config()), seed)
