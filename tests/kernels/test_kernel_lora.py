"""LoRA shrink and expand against their torch references: mixed slots, base tokens between them, idle slots,
ranks padded to the max, a fused projection's slices, no LoRA token at all, and the shrink's prologues (the RMS
norm, SiLU-and-mul) against the model's own ops; the folded projection's expand against its own."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.lora.expand import lora_expand, lora_expand_ref
from tgi_compat.kernels.lora.expand_folded import lora_expand_folded, lora_expand_folded_ref
from tgi_compat.kernels.lora.shrink import (
    ShrinkPrologue,
    lora_shrink,
    lora_shrink_ref,
    shrink_prologue_ref,
    shrink_split_k,
)
from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.modeling.layers.ops import torch_rms_norm, torch_silu_and_mul
from tgi_compat.modeling.lora.step import build_lora_step, lora_step

MAX_LORAS = 4
# Under the interpreter on CPU the kernels compute in fp32; on a GPU their fp32 dots run as TF32 (10-bit mantissa).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-4, atol=1e-4) if DEV == "cpu" else dict(rtol=2e-2, atol=2e-2)


def _step(request_slots: list[int], q_lens: list[int]):
    total = sum(q_lens)
    batch = build_forward_batch([0] * total, list(range(len(q_lens))), q_lens, q_lens, list(range(total)), [0])
    return build_lora_step(batch, torch.tensor(request_slots), MAX_LORAS)


def test_segments_sort_tokens_by_slot_and_leave_base_tokens_out():
    step = _step([2, -1, 0, 2], [2, 3, 1, 2])  # tokens 0-1 slot 2, 2-4 base, 5 slot 0, 6-7 slot 2
    assert step.seg_len.tolist() == [1, 0, 4, 0]
    assert step.seg_start.tolist() == [0, 1, 1, 5]
    assert step.token_order[:5].tolist() == [5, 0, 1, 6, 7]


@pytest.mark.parametrize(
    "request_slots, q_lens",
    [
        ([2, -1, 0, 2], [2, 3, 1, 2]),
        ([1, 1, 1], [1, 1, 1]),
        ([-1, -1], [4, 1]),
        ([3, 0, 1, 2, -1], [17, 1, 5, 1, 2]),
        ([2, -1, 0], [40, 3, 33]),  # segments of several blocks, an idle slot between them
    ],
)
@pytest.mark.parametrize("size_in", [40, 1000])  # 1000: the shrink splits K in 3 (shrink_split_k), K % 64 != 0
def test_shrink_and_expand_match_their_references(request_slots, q_lens, size_in):
    torch.manual_seed(0)
    with torch.device(DEV):
        _check_shrink_and_expand(request_slots, q_lens, size_in, QKV_LIKE)


# one launch for every slice of a fused projection, slice ends inside a 64-column block; an empty slice (a part a
# rank of a sharded model keeps nothing of)
@pytest.mark.parametrize("slices", [[(0, 40), (40, 40)], [(0, 80)], [(0, 48), (48, 0), (48, 32)]])
def test_expand_slices(slices):
    torch.manual_seed(1)
    with torch.device(DEV):
        _check_shrink_and_expand([3, 0, 1, 2, -1], [17, 1, 5, 1, 2], 40, slices)


def test_split_k_only_at_decode_sizes():
    assert shrink_split_k(64, 4096) == 16 and shrink_split_k(1, 14336) == 32
    assert shrink_split_k(1000, 4096) == 1 and shrink_split_k(8, 40) == 1 and shrink_split_k(8, 1000) == 3


QKV_LIKE = [(0, 48), (48, 16), (64, 16)]


def _check_shrink_and_expand(
    request_slots: list[int], q_lens: list[int], size_in: int, slices: list[tuple[int, int]]
) -> None:
    step = _step(request_slots, q_lens)
    num_tokens, rank = sum(q_lens), 24
    x = torch.randn(num_tokens, size_in)
    # scaled as a LoRA's A is initialized (1 / sqrt(fan_in)): the shrunk rows stay O(1), so that TOL's 1e-4 measures
    # the kernels and not fp32's rounding of sums of size ~sqrt(size_in) (which varies with torch's thread count)
    a = torch.randn(MAX_LORAS, len(slices) * rank, size_in) / size_in**0.5
    a[1, 8:rank] = 0  # slot 1 holds a rank-8 adapter, zero-padded
    b = torch.randn(MAX_LORAS, 80, rank)
    shrunk, ref = lora_shrink(x, a, step), lora_shrink_ref(x, a, step)
    num_lora = int(step.seg_len.sum())
    # each split's partial sums, added by the expand
    assert shrunk.partials.shape[0] == shrink_split_k(num_tokens, size_in) and shrunk.sum_sq is None
    torch.testing.assert_close(shrunk.rows()[:num_lora], ref.rows()[:num_lora], **TOL)
    base = torch.randn(num_tokens, 80)
    out, out_ref = base.clone(), base.clone()
    ends = tuple(start + size for start, size in slices)
    lora_expand(out, shrunk, b, step, ends)
    lora_expand_ref(out_ref, ref, b, step, ends)
    torch.testing.assert_close(out, out_ref, **TOL)
    is_base = torch.tensor([s < 0 for s, n in zip(request_slots, q_lens) for _ in range(n)])
    assert torch.equal(out[is_base], base[is_base])  # base rows untouched
    # the definition, token by token
    slot_of = [s for s, n in zip(request_slots, q_lens) for _ in range(n)]
    for token, slot in enumerate(slot_of):
        if slot >= 0:
            for index, (start, size) in enumerate(slices):
                a_part, b_part = a[slot, index * rank : (index + 1) * rank], b[slot, start : start + size]
                expected = base[token, start : start + size] + b_part @ (a_part @ x[token])
                torch.testing.assert_close(out_ref[token, start : start + size], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prologue", ["norm", "silu_mul"])
@pytest.mark.parametrize("size_in", [40, 1000])
def test_shrink_prologues_match_the_model_ops(prologue, size_in):
    """The shrink of the base op's input equals the plain shrink of the activations the base op computed."""
    torch.manual_seed(2)
    with torch.device(DEV):
        step = _step([2, -1, 0, 2], [2, 3, 1, 2])
        a = torch.randn(MAX_LORAS, 48, size_in)
        weight = torch.randn(size_in)
        x = torch.randn(8, 2 * size_in if prologue == "silu_mul" else size_in)
        pro = ShrinkPrologue(weight, 1e-5) if prologue == "norm" else ShrinkPrologue(silu_mul=True)
        activations = torch_rms_norm(x, weight, 1e-5)[0] if prologue == "norm" else torch_silu_and_mul(x)
        torch.testing.assert_close(shrink_prologue_ref(x, pro), activations, rtol=1e-5, atol=1e-5)
        expected = lora_shrink_ref(activations, a, step).rows()
        num_lora = int(step.seg_len.sum())
        shrunk = lora_shrink(x, a, step, pro)
        # a norm's 1 / rms from the splits' sums of squares, applied to the summed row (by the expand)
        assert (shrunk.sum_sq is not None) == (prologue == "norm")
        torch.testing.assert_close(shrunk.rows()[:num_lora], expected[:num_lora], **TOL)
        torch.testing.assert_close(lora_shrink_ref(x, a, step, pro).rows(), expected, rtol=1e-5, atol=1e-5)
        b = torch.randn(MAX_LORAS, 48, 16)
        out, out_ref = torch.zeros(8, 48), torch.zeros(8, 48)
        lora_expand(out, shrunk, b, step, (16, 32, 48))
        lora_expand_ref(out_ref, lora_shrink_ref(activations, a, step), b, step, (16, 32, 48))
        torch.testing.assert_close(out, out_ref, **TOL)


@pytest.mark.parametrize(
    "slots", [[2, -1, 0, 2, 1], [-1, -1], [3], [i % 5 - 1 for i in range(40)], [i % 3 * 2 - 1 for i in range(100)]]
)
@pytest.mark.parametrize("slice_outs", [(40,), (48, 16, 16), (200, 200)])
def test_row_wise_expand_of_a_folded_projection_matches_its_reference(slots, slice_outs):
    """The base columns of a widened projection's output plus each LoRA row's shrunk[slot] @ B[slot]^T (base rows:
    their base columns unchanged), ranks padded to the max, several output blocks a slice, segments of more rows than
    a program takes."""
    torch.manual_seed(2)
    rank = 16
    ends = tuple(int(e) for e in torch.tensor(slice_outs).cumsum(0))
    with torch.device(DEV):
        token_slots = torch.tensor(slots)
        step = lora_step(token_slots, MAX_LORAS)
        full = torch.randn(len(slots), ends[-1] + MAX_LORAS * len(ends) * rank)
        b = torch.randn(MAX_LORAS, ends[-1], rank)
        b[:, :, rank - 3 :] = 0  # an adapter of a lower rank than the slots'
        out = lora_expand_folded(full, step, b, ends)
        expected = lora_expand_folded_ref(full, step, b, ends)
    torch.testing.assert_close(out, expected, **TOL)
    base_rows = token_slots < 0
    assert torch.equal(out[base_rows], full[base_rows, : ends[-1]])
    if (~base_rows).any():  # the delta is there
        assert not torch.allclose(out[~base_rows], full[~base_rows, : ends[-1]])
