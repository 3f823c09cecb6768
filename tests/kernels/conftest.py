"""Kernel tests run on CPU through Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a kernels/ module is imported.
So this file turns the interpreter on, (re)imports every kernels/ module under it, and restores the
variable at once: nothing else in a shared pytest process sees it, and a module that some other
test package imported earlier (compiled mode) is replaced by its interpreted twin.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

KERNEL_MODULES = [
    "kernels.pdl",
    "kernels.decode_attention",
    "kernels.dequant_matmul",  # before kernels.gemv, which calls its int4 helper
    "kernels.rmsnorm",  # before kernels.quant_activation, which calls its row helper
    "kernels.silu_mul",  # before kernels.gemv and kernels.quant_activation, which call its activation
    "kernels.gemv",
    "kernels.gemv_int4_one_row",  # after kernels.gemv, whose helpers it binds
    "kernels.prefill_attention",
    "kernels.kv_store",
    "kernels.rotary",
    "kernels.fused_moe",
    "kernels.quant_activation",
    "kernels.grammar_apply",
    "kernels.grammar_confine",
    "kernels.greedy_pick",
    "kernels.fp8_gemm",
    "kernels.one_shot_all_reduce",
    "kernels.vocab_embedding",  # after kernels.one_shot_all_reduce, whose send it binds
    # importers of the kernels, reloaded after them so they bind the interpreted versions
    "modeling.attention.triton_backend",
    "modeling.layers.triton_ops",
]


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        # Triton's own helpers (tl.cdiv, ...) were imported interpreted by tests/conftest.py.
        for name in KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not torch.cuda.is_available():
    _import_interpreted()
