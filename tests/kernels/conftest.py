"""Kernel tests run on CPU through Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a tgi_compat/kernels/ module is imported.
So this file turns the interpreter on, (re)imports every tgi_compat/kernels/ module under it, and restores the
variable at once: nothing else in a shared pytest process sees it, and a module that some other
test package imported earlier (compiled mode) is replaced by its interpreted twin.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

KERNEL_MODULES = [
    "tgi_compat.kernels.pdl",
    "tgi_compat.kernels.decode_attention",
    "tgi_compat.kernels.dequant_matmul",  # before tgi_compat.kernels.gemv, which calls its int4 helper
    "tgi_compat.kernels.rmsnorm",  # before tgi_compat.kernels.quant_activation, which calls its row helper
    "tgi_compat.kernels.silu_mul",  # before tgi_compat.kernels.gemv and tgi_compat.kernels.quant_activation, which call its activation
    "tgi_compat.kernels.gemv",
    "tgi_compat.kernels.gemv_int4_one_row",  # after tgi_compat.kernels.gemv, whose helpers it binds
    "tgi_compat.kernels.prefill_attention",
    "tgi_compat.kernels.kv_store",
    "tgi_compat.kernels.rotary",
    "tgi_compat.kernels.fused_moe",
    "tgi_compat.kernels.quant_activation",
    "tgi_compat.kernels.grammar_apply",
    "tgi_compat.kernels.grammar_confine",
    "tgi_compat.kernels.greedy_pick",
    "tgi_compat.kernels.fp8_gemm",
    "tgi_compat.kernels.one_shot_all_reduce",
    "tgi_compat.kernels.lora.shrink",
    "tgi_compat.kernels.lora.expand",
    "tgi_compat.kernels.vocab_embedding",  # after tgi_compat.kernels.one_shot_all_reduce, whose send it binds
    # importers of the kernels, reloaded after them so they bind the interpreted versions
    "tgi_compat.modeling.attention.triton_backend",
    "tgi_compat.modeling.layers.triton_ops",
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
