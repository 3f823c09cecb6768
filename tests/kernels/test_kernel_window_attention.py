"""The window attention kernel (rope on load, one tile a window) against the two-kernel path it replaces: the
rotary's reference, then sdpa per sequence length, at Qwen2.5-VL's vision head size 80 (halves of 40: not powers
of two)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.test_kernel_attention import relative_error


def _windows(lens: list[int], heads: int = 2, head_dim: int = 80, seed: int = 5, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(sum(lens), 3, heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(sum(lens), head_dim // 2, generator=gen) * 6.0
    return cu, qkv, angles.cos(), angles.sin()


def _reference(qkv: torch.Tensor, cu: torch.Tensor, cos, sin, scale: float) -> torch.Tensor:
    from tgi_compat.kernels.attention.rotary import rotary_embedding_ref
    from tgi_compat.kernels.attention.varlen import varlen_attention_ref

    q, k, v = qkv.unbind(1)
    if cos is not None:
        q, k = rotary_embedding_ref(q, cos, sin), rotary_embedding_ref(k, cos, sin)
    return varlen_attention_ref(q.float(), k.float(), v.float(), cu, scale)


@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_attention_matches_rotary_then_sdpa(dtype, rotary):
    window = sys.modules["tgi_compat.kernels.attention.window"]  # the interpreted module conftest.py loaded
    lens = [64, 16, 64, 1, 40]  # whole windows, windows cut at an image's edge, a one-token window
    cu, qkv, cos, sin = _windows(lens, dtype=dtype)
    tables = (cos, sin) if rotary else (None, None)
    out = window.window_attention(qkv, cu, max(lens), 80**-0.5, *tables)
    assert out.shape == (sum(lens), 2, 80) and out.dtype == dtype
    assert relative_error(out, _reference(qkv, cu, *tables, 80**-0.5)) < (1e-5 if dtype == torch.float32 else 5e-3)


def test_window_attention_reads_the_projection_in_place():
    """q, k, v as strided views of one [T, 3 * H * D] projection output; the tables' rows stay the tokens'."""
    window = sys.modules["tgi_compat.kernels.attention.window"]
    lens = [128, 7]  # the longest window a program holds
    cu, qkv, cos, sin = _windows(lens, heads=3, head_dim=32)
    wide = torch.zeros(sum(lens), 2 * 3 * 3 * 32)  # every row twice as long: a strided view below
    wide[:, : 3 * 3 * 32] = qkv.reshape(sum(lens), -1)
    view = wide[:, : 3 * 3 * 32].view(sum(lens), 3, 3, 32)
    before = wide.clone()
    out = window.window_attention(view, cu, max(lens), 0.25, cos, sin)
    assert relative_error(out, _reference(qkv, cu, cos, sin, 0.25)) < 1e-5
    assert torch.equal(wide, before)  # q and k never written back rotated


def test_window_attention_refuses_a_sequence_past_one_tile():
    window = sys.modules["tgi_compat.kernels.attention.window"]
    cu, qkv, cos, sin = _windows([129])
    with pytest.raises(AssertionError):
        window.window_attention(qkv, cu, 129, 1.0, cos, sin)


COMPILE_PROBE = r"""
import json, torch
from benchmarks.compile_only import compiled_kernels, install_compile_only_driver
install_compile_only_driver()
from tgi_compat.kernels.attention.window import _window_attention_kernel, window_attention
tokens = 5476  # one 1024px image's patches
qkv = torch.zeros(tokens, 3, 16, 80, dtype=torch.bfloat16)
cu = torch.arange(0, tokens + 1, 64, dtype=torch.int32)
cos = torch.zeros(tokens, 40)
launches = (
    lambda: window_attention(qkv, cu, 64, 80**-0.5, cos, cos),
    lambda: window_attention(qkv, cu, 64, 80**-0.5),
    lambda: window_attention(qkv.float(), cu, 64, 80**-0.5, cos, cos),  # fp32 serving: ieee dots
)
print(json.dumps([kernel.name for launch in launches for kernel in compiled_kernels(_window_attention_kernel, launch)]))
"""


def test_window_attention_compiles_for_sm90_at_qwen2_5_vl_7b_shapes():
    """bf16, 16 heads of 80, 64-token windows, with and without the rope, and fp32: Triton's compiler for sm_90 (no
    GPU) accepts what the interpreter ran."""
    from benchmarks.compile_only import run_probe

    names = run_probe(COMPILE_PROBE)
    assert names == ["_window_attention_kernel"] * 3, names
