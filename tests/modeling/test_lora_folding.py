"""A plain projection folded for LoRA: its own weight and bias become views of the widened twin's first rows (plain
steps read the same memory), the twin's output is [the projection's | x @ A^T of every slot], and the slot buffer A
is the twin's extra rows (a slot load writes straight into them). An int8 projection is not folded (FP8 is:
tests/kernels/test_kernel_lora_fp8.py)."""

from __future__ import annotations

import torch

from tgi_compat.modeling.layers.linear import Linear, QKVLinear
from tgi_compat.modeling.layers.quantization.int8 import Int8LinearMethod
from tgi_compat.modeling.lora.folding import fold
from tgi_compat.modeling.lora.weights import DEFAULT_FOLDING, LoraWeights

MAX_LORAS, RANK = 3, 4


def test_a_folded_projection_computes_its_output_and_every_slots_shrink():
    torch.manual_seed(0)
    proj = QKVLinear(32, num_heads=4, num_kv_heads=2, head_dim=8, bias=True)
    for param in (proj.weight, proj.bias):
        param.data.normal_()
    before = proj(x := torch.randn(5, 32))
    lora = LoraWeights(proj, ("q_proj", "k_proj", "v_proj"), MAX_LORAS, RANK)
    twin = lora.folded_for(5)
    # the slots' rows (36) are more than an eighth of the 64 output rows: a prefill-sized step takes the segmented path
    assert twin is not None and lora.folded_for(DEFAULT_FOLDING.max_tokens + 1) is None
    rows = proj.out_features  # 32 + 16 + 16
    assert twin.weight.shape == (rows + MAX_LORAS * 3 * RANK, 32)
    assert proj.weight.data_ptr() == twin.weight.data_ptr() and proj.bias.data_ptr() == twin.bias.data_ptr()
    assert lora.a.data_ptr() == twin.weight[rows:].data_ptr() and lora.a.shape == (MAX_LORAS, 3 * RANK, 32)
    assert torch.equal(proj(x), before)  # the plain path: unchanged
    lora.a.normal_()  # as a slot load writes it
    full = twin(x)
    torch.testing.assert_close(full[:, :rows], before)
    torch.testing.assert_close(full[:, rows:], x @ lora.a.reshape(-1, 32).T)  # no bias on the shrunk columns


def test_a_quantized_projection_keeps_separate_a_buffers():
    proj = Linear(32, 16, method=Int8LinearMethod(is_serialized=True))
    assert fold(proj, MAX_LORAS * RANK) is None
    lora = LoraWeights(proj, ("o_proj",), MAX_LORAS, RANK)
    assert lora.folded is None and lora.folded_for(1) is None and lora.a.shape == (MAX_LORAS, RANK, 32)


def test_a_projection_whose_slot_rows_are_a_small_share_folds_at_every_size():
    proj = QKVLinear(32, num_heads=32, num_kv_heads=16, head_dim=8, bias=False)  # 512 output rows
    lora = LoraWeights(proj, ("q_proj", "k_proj", "v_proj"), MAX_LORAS, RANK)  # 36 slot rows: 7%
    assert lora.extra_share <= DEFAULT_FOLDING.max_share
    assert lora.folded is not None and lora.folded_for(DEFAULT_FOLDING.max_tokens + 1) is lora.folded
