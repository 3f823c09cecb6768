"""GPU correctness of the fused-experts kernels at Mixtral-8x7B expert shapes, bf16 (marker `gpu`;
skipped without CUDA): every path (GEMV, 16/32/64-row tiles, the torch sort of a long prefill) against
the expert-by-expert loop in fp32, and a CUDA graph replayed with new routing (the alignment runs in
the graph: no host sync, no shape that depends on the routing).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_fused_moe_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.moe.align import ALIGN_KERNEL_MAX_PAIRS
from tgi_compat.kernels.moe.configs import LaunchConfig, MoeConfig
from tgi_compat.kernels.moe.fused_moe import fused_moe, moe_config
from tgi_compat.kernels.moe.routing import fused_route, route_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
EXPERTS, HIDDEN, INTER, TOP_K = 8, 4096, 14336, 2
GROUPED = LaunchConfig(64, 128, 4, 3, 8)
PATHS = {
    "gemv": MoeConfig(0, LaunchConfig(4, 512, 4, 1), LaunchConfig(4, 512, 4, 1)),
    "m16": MoeConfig(16, GROUPED, GROUPED),
    "m32": MoeConfig(32, GROUPED, GROUPED),
    "m64": MoeConfig(64, GROUPED, GROUPED),
}


@pytest.fixture(scope="module")
def experts():
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEV, dtype=torch.bfloat16) * 0.02
    return w13, w2


def routed(num_tokens: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(num_tokens, EXPERTS, device=DEV, generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return x, weights, ids


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def loop_reference(experts, x, weights, ids) -> torch.Tensor:
    """fp32 products of the bf16 weights, expert by expert (the fp32 copy of one expert at a time)."""
    w13, w2 = experts
    out = torch.zeros(x.shape, device=DEV, dtype=torch.float32)
    for expert in ids.unique().tolist():
        tokens, slot = torch.where(ids == expert)
        gate, up = (x[tokens].float() @ w13[expert].float().T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[expert].float().T
        out.index_add_(0, tokens, y * weights[tokens, slot, None])
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 64, 300, ALIGN_KERNEL_MAX_PAIRS // TOP_K + 50])
def test_configured_path_matches_the_loop(experts, num_tokens):
    x, weights, ids = routed(num_tokens, num_tokens)
    out = fused_moe(x, *experts, weights, ids)
    err = rel_err(out, loop_reference(experts, x, weights, ids))
    print(f"{num_tokens} tokens, {moe_config(num_tokens, EXPERTS, TOP_K, INTER, HIDDEN)}: rel err {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_matches_the_loop(experts, path):
    x, weights, ids = routed(8 if path == "gemv" else 40, 7)
    err = rel_err(fused_moe(x, *experts, weights, ids, PATHS[path]), loop_reference(experts, x, weights, ids))
    assert err < 1e-2, (path, err)


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_graph_replays_with_new_routing(experts, num_tokens):
    x, weights, ids = routed(num_tokens, 1)
    fused_moe(x, *experts, weights, ids)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, *experts, weights, ids)
    for seed in (2, 3):
        new_x, new_weights, new_ids = routed(num_tokens, seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert rel_err(out, loop_reference(experts, x, weights, ids)) < 1e-2


@pytest.mark.parametrize("num_experts,top_k,renormalize", [(8, 2, True), (60, 4, False), (128, 8, True)])
def test_fused_route_matches_softmax_topk(num_experts, top_k, renormalize):
    logits = torch.randn(64, num_experts, device=DEV, dtype=torch.bfloat16) * 3
    weights, ids = fused_route(logits, top_k, renormalize)
    ref_weights, ref_ids = route_ref(logits, top_k, renormalize)
    probs = logits.float().softmax(-1)  # equal probabilities (bf16 logits tie) may come in either order
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ref_ids), rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
