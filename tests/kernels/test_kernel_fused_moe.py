"""The fused-experts grouped GEMM against the expert-by-expert reference (small shapes, interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import align_by_expert, fused_moe, fused_moe_ref
from tests.kernels.test_kernel_attention import relative_error


def test_alignment_groups_every_pair_under_its_expert_in_padded_tiles():
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]])
    alignment = align_by_expert(topk_ids, num_experts=5, block_m=4)
    pairs, num_pairs = alignment.sorted_pairs, topk_ids.numel()
    used = int(alignment.num_padded)
    assert used == 4 * 4  # experts 0, 1, 2, 3 use one tile each; expert 4 none
    assert sorted(p for p in pairs[:used].tolist() if p < num_pairs) == list(range(num_pairs))
    assert (pairs[used:] == num_pairs).all()
    flat = topk_ids.flatten()
    for tile, expert in enumerate(alignment.tile_experts[: used // 4].tolist()):
        rows = [p for p in pairs[tile * 4 : tile * 4 + 4].tolist() if p < num_pairs]
        assert rows and all(flat[p] == expert for p in rows)


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_matches_reference(num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 6, 2, 48, 40  # sizes off the block multiples: masks matter
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, block_m=16, block_n=32, block_k=32)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert out.dtype == dtype
    assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)
