"""The embedded SmolLM2 GGUF: our dequantization + q/k un-permutation + model give transformers'
logits on the same file."""

from __future__ import annotations

import pytest

from tests.modeling.helpers import full_logits, hf_logits, max_rel_error

pytestmark = pytest.mark.latest_deps  # in the smoke set of `make test-latest`

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


@pytest.mark.parametrize("text", PROMPTS)
def test_gguf_logits_match_transformers(text, smollm2_runner, smollm2_hf_model, smollm2_tokenizer):
    ids = smollm2_tokenizer(text).input_ids
    ours = full_logits(smollm2_runner, ids)
    assert max_rel_error(ours, hf_logits(smollm2_hf_model, ids)) <= 1e-4


def test_gguf_config_matches_the_file(smollm2_runner):
    config = smollm2_runner.model_config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.vocab_size == smollm2_runner.vocab_size == 49152
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
