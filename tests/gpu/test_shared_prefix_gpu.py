"""The shared-prefix (--diverse_mode) decode kernel on the GPU at Llama-3-8B attention shapes: 32 q heads, 8 KV
heads, d = 128, groups of G = 8 rows on a 2,000-token prefix, bf16 (and fp16, fp32), against its torch reference
and against today's flash-decoding; inside a CUDA graph whose group table changes between replays; and end to end,
diverse mode on vs off through engines with CUDA graphs.

    PYTHONPATH=$PWD python -m pytest -q -s tests/gpu/test_shared_prefix_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.device.diverse import check_same_tokens, kernel_rows
from tgi_compat.kernels.attention.decode import choose_num_splits, decode_attention
from tgi_compat.kernels.attention.shared_prefix import (
    choose_prefix_splits,
    shared_prefix_decode_attention,
    shared_prefix_decode_ref,
)
from tgi_compat.modeling.forward_batch import PrefixGroups

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LLAMA3_8B_HEADS = (32, 8, 128)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shared_prefix_matches_reference_at_llama3_8b_shapes(groups: int, dtype: torch.dtype):
    torch.manual_seed(groups)
    q, k_cache, v_cache, r2t, rows, kv_lens, table = kernel_rows(groups, 2000, LLAMA3_8B_HEADS, "cuda", seed=groups)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    batch, scale = q.shape[0], 128**-0.5
    ref = shared_prefix_decode_ref(q, k_cache, v_cache, r2t, rows, kv_lens, table, scale)
    today = decode_attention(q, k_cache, v_cache, r2t, rows, kv_lens, scale, choose_num_splits(batch, 8, 132))
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    for splits, prefix_splits, block_n in [(1, 4, 64), (2, 1, 128), (choose_num_splits(batch, 8, 132), 16, 64)]:
        out = torch.full_like(q, float("nan"))
        shared_prefix_decode_attention(
            q, k_cache, v_cache, r2t, rows, kv_lens, table, scale, splits, prefix_splits, out=out, block_n=block_n
        )
        err, err_today = rel_err(out, ref), rel_err(out, today)
        print(f"G=8 x {groups} {dtype} splits={splits}+{prefix_splits}: vs ref {err:.2e}, vs today {err_today:.2e}")
        assert err < tolerance and err_today < tolerance


@pytest.mark.parametrize("groups", [1, 8, 16])
def test_shared_prefix_at_the_split_counts_the_backend_picks(groups: int):
    """The prefix split counts choose_prefix_splits gives on this GPU (6 at 8 groups on an H200's 132 SMs), and
    around them: 2000 keys in splits of 64-key blocks, so the last split is partly filled and, past 32 splits, some
    are empty; fewer group programs than groups (each takes several in turn) too."""
    q, k_cache, v_cache, r2t, rows, kv_lens, table = kernel_rows(groups, 2000, LLAMA3_8B_HEADS, "cuda", seed=groups)
    batch, scale = q.shape[0], 128**-0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(batch, 8, sms)
    chosen = choose_prefix_splits(batch, 8, 8, sms, r2t.shape[1], 64, 64 - splits)
    ref = shared_prefix_decode_ref(q, k_cache, v_cache, r2t, rows, kv_lens, table, scale)
    for prefix_splits, slots in [(chosen, 0), (chosen + 5, 0), (7, 1), (min(40, 64 - splits), max(1, groups // 3))]:
        out = torch.full_like(q, float("nan"))
        shared_prefix_decode_attention(
            q, k_cache, v_cache, r2t, rows, kv_lens, table, scale, splits, prefix_splits, out=out, prefix_slots=slots
        )
        err = rel_err(out, ref)
        print(f"G=8 x {groups}: splits={splits}+{prefix_splits}, group programs {slots or groups}: vs ref {err:.2e}")
        assert err < 1e-2


def test_shared_prefix_in_a_cuda_graph_follows_its_group_table():
    """Captured once with 4 groups; replayed after the table changes to other groups and to none."""
    q, k_cache, v_cache, r2t, rows, kv_lens, table = kernel_rows(4, 2000, LLAMA3_8B_HEADS, "cuda", seed=7)
    batch, scale = q.shape[0], 128**-0.5
    out = torch.empty_like(q)

    prefix_splits = choose_prefix_splits(
        batch, 8, 8, torch.cuda.get_device_properties(0).multi_processor_count, 2256, 64, 63
    )

    def step() -> None:
        shared_prefix_decode_attention(q, k_cache, v_cache, r2t, rows, kv_lens, table, scale, 1, prefix_splits, out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    regroupings = [
        PrefixGroups.rows([(2000, list(range(g * 8, g * 8 + 8))) for g in range(4)], batch, 8),  # as captured
        PrefixGroups.rows([(2000, [0, 9, 17, 25]), (1500, [8, 16])], batch, 8),  # other groups, a shorter share
        PrefixGroups.rows([(2000, [g, g + 16]) for g in range(16)], batch, 8),  # 16 groups on 4 group programs
        PrefixGroups.rows([], batch, 8),  # no group: flash-decoding
    ]
    for rows_table in regroupings:
        table.copy_(torch.tensor(rows_table, dtype=table.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = shared_prefix_decode_ref(q, k_cache, v_cache, r2t, rows, kv_lens, table, scale)
        assert rel_err(out, ref) < 1e-2


def test_engine_tokens_equal_with_diverse_mode_on_and_off():
    """A small float32 Llama through in-process engines with CUDA graphs: n = 8 siblings of three prompts (greedy
    and seeded) and three loners give the same tokens with the mode on as off, and the siblings were grouped."""
    check = check_same_tokens("cuda")
    assert check["identical"] == check["requests"] and check["largest_group"] == 8, check
