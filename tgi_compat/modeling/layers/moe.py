"""A sparse mixture-of-experts MLP block: a router, E SwiGLU experts run together, and optionally a
shared expert scaled by its own sigmoid gate (Qwen2-MoE).

The experts' weights are stacked, w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], which
is what the grouped GEMM in tgi_compat/kernels/moe/fused_moe.py reads. On CUDA the router's top-k and the experts run
through its kernels; on CPU through their references (torch routing and an expert-by-expert loop, as
transformers does).

Tensor parallelism splits every expert's intermediate dim across the ranks (column-parallel gate|up,
row-parallel down), and the shared expert's likewise; the router is replicated, so every rank routes
each token to the same experts, and one all-reduce after the block sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tgi_compat.kernels.moe.fused_moe import fused_moe, fused_moe_ref
from tgi_compat.kernels.moe.routing import fused_route, route_ref
from tgi_compat.modeling.layers.linear import Linear, LoadableParameter, MergedLinear, default_weight_loader
from tgi_compat.modeling.layers.norm import RMSNorm
from tgi_compat.modeling.layers.ops import LayerOps, sum_now
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, split_evenly
from tgi_compat.modeling.weights.lazy import LazyTensor, take

_PARTS = {"gate": 0, "up": 1}  # row blocks of w13


class FusedExperts(nn.Module):
    """Every expert's gate|up and down, stacked; under tensor parallelism this rank's slice of each
    expert's intermediate dim (`self.slice` of `full_intermediate_size`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel = NO_TP):
        super().__init__()
        self.full_intermediate_size = intermediate_size
        self.slice = split_evenly(intermediate_size, tp.size, tp.rank)
        self.intermediate_size = size = self.slice.size
        self.w13 = LoadableParameter(torch.empty(num_experts, 2 * size, hidden_size), requires_grad=False)
        self.w2 = LoadableParameter(torch.empty(num_experts, hidden_size, size), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.load_expert

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
        """shard: (expert, "gate" | "up" | "down") for one expert's matrix; None for all experts at
        once ([E, 2I, H] gate rows then up rows, or [E, H, I])."""
        if shard is None:
            if param is self.w2:
                default_weight_loader(param, self._rank_columns(loaded, dim=2))
            else:
                for index, target in enumerate(param.data.chunk(2, dim=1)):
                    default_weight_loader(target, self._rank_rows(loaded, dim=1, part=index))
            return
        assert isinstance(shard, tuple), shard
        expert, part = shard
        target = param.data[expert]
        if part in _PARTS:
            target = target.narrow(0, _PARTS[part] * self.intermediate_size, self.intermediate_size)
            default_weight_loader(target, self._rank_rows(loaded, dim=0, part=0))
        else:
            default_weight_loader(target, self._rank_columns(loaded, dim=1))

    def _rank_rows(self, loaded: torch.Tensor | LazyTensor, dim: int, part: int) -> torch.Tensor:
        """This rank's intermediate rows of gate (part 0) or up (part 1) along dim."""
        return take(loaded, dim, part * self.full_intermediate_size + self.slice.start, self.slice.size)

    def _rank_columns(self, loaded: torch.Tensor | LazyTensor, dim: int) -> torch.Tensor:
        """This rank's intermediate columns of down along dim."""
        return take(loaded, dim, self.slice.start, self.slice.size)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        run = fused_moe if x.is_cuda else fused_moe_ref
        return run(x, self.w13, self.w2, topk_weights, topk_ids)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: LayerOps, tp: TensorParallel = NO_TP):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        in_slice = split_evenly(intermediate_size, tp.size, tp.rank)
        self.down_proj = Linear(intermediate_size, hidden_size, in_slice=in_slice, tp=tp)  # partial sums
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul_linear(self.gate_up_proj(x), self.down_proj)


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        ops: LayerOps,
        shared_intermediate_size: int = 0,
        tp: TensorParallel = NO_TP,
    ):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts)  # the router: replicated on every rank
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, tp)
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size, ops, tp)
            self.shared_expert_gate = Linear(hidden_size, 1)  # replicated: scales each rank's partial sum
        self.tp = tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] fp32, expert ids [T, top_k]): softmax in fp32, top-k, maybe renormalised."""
        logits = self.gate(x)
        run = fused_route if logits.is_cuda else route_ref
        return run(logits, self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (already normed) -> [T, hidden]."""
        out = self.experts(x, *self.route(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)  # the ranks' partial sums: one all-reduce for the whole block

    def norm_and_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, sum_over: TensorParallel | None
    ) -> tuple[torch.Tensor, torch.Tensor, TensorParallel | None]:
        """A decoder layer's feed-forward (models/decoder.py): the router reads the normed stream, so
        the norm runs on its own (after the attention output's sum, where it is pending)."""
        hidden = sum_now(hidden, sum_over)
        normed, summed = norm(hidden, residual)
        assert summed is not None  # a residual in gives the sum out
        return self(normed), summed, None
