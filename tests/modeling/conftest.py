"""Session-scoped SmolLM2 fixtures: our runner and the tokenizer (transformers' reference model,
`smollm2_hf_model`, is in tests/conftest.py, shared with the other trees)."""

from __future__ import annotations

import pytest

from tgi_compat.modeling.runner import ModelRunner, RunnerConfig


@pytest.fixture(scope="session")
def smollm2_runner() -> ModelRunner:
    return ModelRunner(RunnerConfig(device="cpu", dtype="float32", num_kv_slots=8192, max_rows=8, show_progress=False))
