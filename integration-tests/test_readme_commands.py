"""The README's two curl lines against the launcher, and Hugging Face's `kernels` beside our engine.

Part of the smoke set `make test-latest` runs with the newest dependencies pyproject.toml allows.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.latest_deps

QUESTION = "What is the capital of France?"


async def test_readme_generate(http):
    response = await http.post("/generate", json={"inputs": QUESTION, "parameters": {"max_new_tokens": 20}})
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["generated_text"], str)


async def test_readme_chat_completion(http):
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_hf_kernels_imports_beside_our_engine():
    """transformers >= 5.25 imports Hugging Face's top-level `kernels`; ours lives at tgi_compat.kernels."""
    pytest.importorskip("kernels")
    probe = (
        "import sys; before = list(sys.path)\n"
        "import tgi_compat.router.engine, tgi_compat.modeling.runner, tgi_compat.kernels.gemv.gemv\n"
        "import kernels, transformers.utils.import_utils as u\n"
        "assert sys.path == before, 'importing tgi_compat edited sys.path'\n"
        "assert 'tgi_compat' not in kernels.__file__ and u.is_kernels_available()\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=2, vocab_size=64))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
