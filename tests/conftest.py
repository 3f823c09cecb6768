"""Fixtures every test tree shares.

transformers' reference model of the embedded SmolLM2 loads once per session for all of them
(tests.modeling.helpers.smollm2_reference_model: converted from the GGUF once, then cached).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.modeling.helpers import smollm2_reference_model


def _import_triton_interpreted() -> None:
    """Without a GPU, Triton's own @jit helpers (tl.cdiv, the reductions, gluon's copies) must be
    the interpreter's: Triton decorates them once, when it is first imported, so that import happens
    here, before any test module pulls in a kernel. The variable is restored at once so that server
    subprocesses started by tests do not inherit it (tests/kernels/conftest.py re-imports tgi_compat/kernels/)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.experimental.gluon  # noqa: F401  (imports triton.language as well)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not torch.cuda.is_available():
    _import_triton_interpreted()


@pytest.fixture(scope="session")
def smollm2_hf_model():
    return smollm2_reference_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded model's tokenizer (converted from the GGUF once, then cached)."""
    from tgi_compat.modeling.tokenizer import load_tokenizer

    return load_tokenizer()
