"""The fused-experts kernels against the expert-by-expert reference (small shapes, interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernel_attention import relative_error
from tgi_compat.kernels.moe.align import align_by_expert, align_by_expert_torch
from tgi_compat.kernels.moe.configs import LaunchConfig, MoeConfig
from tgi_compat.kernels.moe.expert_gemv import moe_gemv_down
from tgi_compat.kernels.moe.fused_moe import default_moe_config, fused_moe, fused_moe_ref, moe_config, token_bucket
from tgi_compat.kernels.moe.grouped_gemm import grouped_gemm
from tgi_compat.kernels.moe.routing import fused_route, route_ref

F32, F16 = torch.float32, torch.float16


@pytest.mark.parametrize("align", [align_by_expert, align_by_expert_torch])
def test_alignment_groups_every_pair_under_its_expert_in_padded_tiles(align):
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]])
    alignment = align(topk_ids, num_experts=5, block_m=4)
    pairs, num_pairs = alignment.sorted_pairs, topk_ids.numel()
    used = int(alignment.num_padded)
    assert used == 4 * 4  # experts 0, 1, 2, 3 use one tile each; expert 4 none
    assert sorted(p for p in pairs[:used].tolist() if p < num_pairs) == list(range(num_pairs))
    assert (pairs[used:] == num_pairs).all()
    flat = topk_ids.flatten()
    for tile, expert in enumerate(alignment.tile_experts[: used // 4].tolist()):
        rows = [p for p in pairs[tile * 4 : tile * 4 + 4].tolist() if p < num_pairs]
        assert rows and all(flat[p] == expert for p in rows)


@pytest.mark.parametrize("num_experts,block_m", [(6, 16), (60, 16), (8, 64)])
def test_alignment_kernel_equals_the_torch_sort(num_experts, block_m):
    """Both keep each expert's pairs in pair order (a stable sort), so the layouts are identical,
    across several of the kernel's chunks of pairs and with experts that got nothing."""
    gen = torch.Generator().manual_seed(num_experts)
    topk_ids = torch.randint(0, num_experts - 1, (150, 2), generator=gen)  # the last expert unused
    kernel, ref = align_by_expert(topk_ids, num_experts, block_m), align_by_expert_torch(topk_ids, num_experts, block_m)
    assert torch.equal(kernel.num_padded, ref.num_padded)
    assert torch.equal(kernel.sorted_pairs, ref.sorted_pairs)
    used_tiles = int(ref.num_padded) // block_m
    assert torch.equal(kernel.tile_experts[:used_tiles], ref.tile_experts[:used_tiles])


GEMV = LaunchConfig(block_n=8, block_k=32, num_warps=4, num_stages=1)
CONFIGS = {
    "gemv": MoeConfig(0, GEMV, LaunchConfig(block_n=16, block_k=16, num_warps=2, num_stages=1)),
    "m16": MoeConfig(16, LaunchConfig(32, 32, group_m=1), LaunchConfig(32, 32, group_m=1)),
    "m32-grouped": MoeConfig(32, LaunchConfig(16, 64, group_m=4), LaunchConfig(64, 16, group_m=2)),
    "m64": MoeConfig(64, LaunchConfig(32, 32, group_m=8), LaunchConfig(32, 32, group_m=8)),
}


CASES = [  # (path, tokens, dtype): each path at the token counts it serves, both dtypes over the set
    ("gemv", 1, F32),
    ("gemv", 3, F16),
    ("m16", 1, F16),
    ("m16", 7, F32),
    ("m16", 40, F16),
    ("m32-grouped", 40, F32),
    ("m64", 40, F16),
]


@pytest.mark.parametrize("config,num_tokens,dtype", CASES)
def test_fused_moe_matches_reference(config, num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 6, 2, 48, 40  # sizes off the block multiples: masks matter
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, CONFIGS[config])
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert out.dtype == dtype
    assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize(
    "launch,dtype", [("gemv_down", F32), ("grouped_up", F32), ("grouped_up", F16), ("grouped_down", F32)]
)
def test_each_launch_alone(launch, dtype):
    """Each kernel as the first launch of its test (benchmarks/compile_only.py compiles only a
    test's first launch), fed the torch alignment; fp32 against the loop's intermediate values."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, hidden, inter = 5, 4, 2, 48, 40
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    h = torch.randn(num_tokens * top_k, inter, generator=gen)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    topk_weights, topk_ids = torch.randn(num_tokens, num_experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    pair_expert, pair_weight = topk_ids.flatten(), topk_weights.flatten()
    down_ref = torch.einsum("pk,pnk->pn", h, w2[pair_expert]) * pair_weight[:, None]  # [pairs, H]
    if launch == "gemv_down":
        out = moe_gemv_down(h, w2, topk_weights, topk_ids, LaunchConfig(block_n=16, block_k=16))
        ref = down_ref.view(num_tokens, top_k, hidden).sum(1)
    else:
        alignment = align_by_expert_torch(topk_ids, num_experts, block_m=16)
        config = LaunchConfig(block_n=32, block_k=16, group_m=2)
        if launch == "grouped_up":
            out = torch.empty(num_tokens * top_k, inter, dtype=dtype)
            grouped_gemm(x, w13, out, alignment, None, top_k, True, True, config)
            x, w13 = x.float(), w13.float()
            gate, up = torch.einsum("pk,pnk->pn", x.repeat_interleave(top_k, 0), w13[pair_expert]).chunk(2, -1)
            ref = torch.nn.functional.silu(gate) * up
        else:
            out = torch.empty(num_tokens * top_k, hidden)
            grouped_gemm(h, w2, out, alignment, pair_weight.contiguous(), top_k, False, False, config)
            ref = down_ref
    assert relative_error(out, ref) < (1e-5 if dtype == F32 else 5e-3)


def test_config_follows_the_token_count():
    """Decode with a few pairs takes the GEMV path; more tokens per expert take taller tiles."""
    assert token_bucket(1) == 1 and token_bucket(3) == 4 and token_bucket(10**6) == 4096
    assert default_moe_config(1, 8, 2).block_m == 0
    block_ms = [default_moe_config(t, 8, 2).block_m for t in (8, 64, 1024)]
    assert block_ms == sorted(block_ms) and block_ms[0] == 16 and block_ms[-1] == 64
    assert moe_config(3, 6, 2, 40, 48) == default_moe_config(3, 6, 2)  # a shape the measured table lacks


@pytest.mark.parametrize("num_experts,top_k,renormalize", [(8, 2, True), (60, 4, False), (128, 8, True)])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_fused_route_matches_softmax_topk(num_experts, top_k, renormalize, dtype):
    gen = torch.Generator().manual_seed(num_experts)
    logits = (3 * torch.randn(5, num_experts, generator=gen)).to(dtype)
    weights, ids = fused_route(logits, top_k, renormalize)
    ref_weights, ref_ids = route_ref(logits, top_k, renormalize)
    probs = logits.float().softmax(-1)  # equal probabilities (bf16 logits tie) may come in either order
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ref_ids), rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
