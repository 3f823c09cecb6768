"""Session-wide SmolLM2 fixtures: loading a model takes tens of seconds, so each loads once."""

from __future__ import annotations

import pytest
from smollm2_cases import SMOLLM2_MAX_NEW, SMOLLM2_PROMPTS, smollm2_engine_config


@pytest.fixture(scope="session")
def smollm2_llm():
    from tgi_compat.router.offline import LLM

    return LLM(smollm2_engine_config())


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_llm):
    """Our greedy ids for every prompt, all in one continuous batch through the offline API."""
    results = smollm2_llm.generate(SMOLLM2_PROMPTS, max_new_tokens=SMOLLM2_MAX_NEW, ignore_eos=True)
    return [result.token_ids for result in results]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A randomly initialised 2-layer Llama saved as safetensors: loads in well under a second."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    from tests.modeling.helpers import TINY_SIZES

    config = LlamaConfig(**TINY_SIZES, bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)
