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
from unittest import mock

import pytest
import torch

# Each after the modules whose jit functions it calls: a reload rebinds the names a module imported, so one
# reloaded before its dependency would keep calling the compiled versions.
KERNEL_MODULES = [
    "tgi_compat.kernels.pdl",
    "tgi_compat.kernels.elementwise.rmsnorm",
    "tgi_compat.kernels.elementwise.silu_mul",
    "tgi_compat.kernels.attention.online_softmax",
    "tgi_compat.kernels.attention.decode_merge",
    "tgi_compat.kernels.attention.decode_rotary",
    "tgi_compat.kernels.attention.decode",
    "tgi_compat.kernels.attention.shared_prefix_programs",
    "tgi_compat.kernels.attention.shared_prefix",
    "tgi_compat.kernels.attention.prefill",
    "tgi_compat.kernels.attention.varlen",
    "tgi_compat.kernels.attention.kv_store",
    "tgi_compat.kernels.attention.rotary",
    "tgi_compat.kernels.attention.window",
    "tgi_compat.kernels.quant.int4_layout",
    "tgi_compat.kernels.quant.dequant_matmul",
    "tgi_compat.kernels.quant.per_token",
    "tgi_compat.kernels.quant.fp8_gemm",
    "tgi_compat.kernels.comm.one_shot_all_reduce",
    "tgi_compat.kernels.comm.vocab_embedding",
    "tgi_compat.kernels.gemv.prologue",
    "tgi_compat.kernels.gemv.epilogue",
    "tgi_compat.kernels.gemv.dense",
    "tgi_compat.kernels.gemv.int4",
    "tgi_compat.kernels.gemv.int4_one_row",
    "tgi_compat.kernels.gemv.gemv",
    "tgi_compat.kernels.moe.routing",
    "tgi_compat.kernels.moe.align",
    "tgi_compat.kernels.moe.grouped_gemm",
    "tgi_compat.kernels.moe.expert_gemv",
    "tgi_compat.kernels.moe.fused_moe",
    "tgi_compat.kernels.sampling.grammar_apply",
    "tgi_compat.kernels.sampling.grammar_confine",
    "tgi_compat.kernels.sampling.greedy_pick",
    "tgi_compat.kernels.sampling.race_pick",
    "tgi_compat.kernels.lora.tiles",
    "tgi_compat.kernels.lora.shrink",
    "tgi_compat.kernels.lora.expand",
    "tgi_compat.kernels.lora.expand_folded",
    # importers of the kernels, reloaded after them so they bind the interpreted versions
    "tgi_compat.modeling.attention.triton_backend",
    "tgi_compat.modeling.layers.triton_ops",
]


def _import_interpreted() -> None:
    # Triton's own helpers (tl.cdiv, ...) were imported interpreted by tests/conftest.py.
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):  # restored after, as there
        for name in KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)


if not torch.cuda.is_available():
    _import_interpreted()


# A tiny Llama (GQA 8:2, head_dim 16) for the tests that run the Triton backend inside a real runner or engine.
TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=97,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def tiny_weights():
    """TINY_LLAMA's (hf config dict, random fp32 state dict), seed 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = dict(TINY_LLAMA)
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return hf_config.to_dict(), model.state_dict()
