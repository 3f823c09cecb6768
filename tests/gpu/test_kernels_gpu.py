"""GPU correctness: every kernel vs its reference at real shapes, then end to end (marker `gpu`;
skipped without CUDA, so CI collects and skips them).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu
Thresholds (METHOD.md): relative L2 error vs an fp32 reference; fp32 kernels < 1e-4 (ieee dots),
bf16/fp16 < 1e-2; NaN never passes; outputs are poisoned with NaN before each run.
End to end: random small Llama and Qwen2; fp32 greedy ids of the triton backend (with CUDA graphs)
equal the torch backend's and transformers'; bf16 logits (teacher-forced) within 2e-2 relative.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.device.steps import build_runner, capture_graphs, greedy_generate, hf_model
from benchmarks.shapes import decoder
from tgi_compat.kernels.attention.decode import (
    choose_block_n,
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)
from tgi_compat.kernels.attention.decode_rotary import NewTokenKV
from tgi_compat.kernels.attention.kv_store import kv_store, kv_store_ref
from tgi_compat.kernels.attention.prefill import prefill_attention, prefill_attention_ref
from tgi_compat.kernels.attention.rotary import rotary_and_kv_store, rotary_embedding, rotary_embedding_ref
from tgi_compat.kernels.elementwise.rmsnorm import (
    norm_add_rmsnorm,
    norm_add_rmsnorm_ref,
    qk_rmsnorm,
    qk_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from tgi_compat.kernels.elementwise.silu_mul import silu_mul, silu_mul_ref
from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.types import QuantizedWeight
from tgi_compat.kernels.quant.dequant_matmul import dequant_matmul, dequant_matmul_ref
from tgi_compat.kernels.quant.fp8_gemm import Fp8GemmConfig, fp8_gemm, fp8_gemm_ref
from tgi_compat.kernels.quant.int4_layout import pack_int4
from tgi_compat.kernels.quant.per_token import quant_per_token, rmsnorm_quant_per_token
from tgi_compat.kernels.split_k import split_k_counters
from tgi_compat.modeling.layers.quantization.fp8 import quantize_weight_per_channel

DEV = "cuda"
RESULTS: list[tuple[str, float, float]] = []  # (check, error, threshold)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def every_check_passes():
    """A test runs all its checks (each printed), then fails if any missed its threshold."""
    torch.manual_seed(0)
    RESULTS.clear()
    yield
    failed = [r for r in RESULTS if not r[1] < r[2]]
    assert not failed, failed


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(name: str, err: float, threshold: float, measure: str = "rel err") -> None:
    RESULTS.append((name, err, threshold))
    print(f"{'PASS' if err < threshold else 'FAIL'} {name}: {measure} {err:.2e} (< {threshold:.0e})", flush=True)


def check_bits(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """`out` holds `ref`'s bits but in at most 1% of its elements, where 1/rms differed in its last bit (torch's
    rsqrt against the kernel's sqrt and divide, another sum order) and flipped a rounding; those stay small."""
    check(f"{name}: elements not bit-equal", (out != ref).float().mean().item(), 1e-2, "fraction")
    check(f"{name}", rel_err(out, ref), 1e-3)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 1e-2


def paged_cache(kv_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """KV cache with every request's tokens in scattered slots (a random permutation)."""
    max_len = max(kv_lens)
    num_slots = len(kv_lens) * max_len + 7
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, device=DEV, dtype=dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, device=DEV, dtype=dtype)
    req_to_token = torch.randperm(num_slots, device=DEV)[: len(kv_lens) * max_len].view(len(kv_lens), max_len)
    rows = torch.randperm(len(kv_lens), device=DEV)
    return k_cache, v_cache, req_to_token.to(torch.int32).contiguous(), rows


def test_decode_attention() -> None:
    for heads, kv_heads, head_dim in [(32, 8, 128), (28, 4, 128), (16, 16, 64)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            kv_lens = [1, 4097, 37, 1500, 64, 3000, 2, 777]
            k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
            q = torch.randn(len(kv_lens), heads, head_dim, device=DEV, dtype=dtype)
            kv = torch.tensor(kv_lens, device=DEV)
            ref = decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5)
            for splits in (1, 5, choose_num_splits(len(kv_lens), kv_heads, 132)):
                for block_n in (64, 128):
                    out = torch.full_like(q, float("nan"))
                    decode_attention(
                        q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5, splits, out=out, block_n=block_n
                    )
                    check(
                        f"decode {heads}/{kv_heads}x{head_dim} {dtype} splits={splits} block={block_n}",
                        rel_err(out, ref),
                        tolerance(dtype),
                    )


def test_decode_attention_merged() -> None:
    """Stage 2 merged into stage 1 (ticket counter): real shapes, both block sizes, the batch-1 split
    counts, two calls on one counter, and the counter back at zero after each."""
    shapes = [
        (32, 8, 128, torch.bfloat16),
        (32, 8, 128, torch.float32),
        (28, 4, 128, torch.bfloat16),
        (16, 16, 64, torch.bfloat16),
    ]
    for (heads, kv_heads, head_dim, dtype), kv_lens in itertools.product(
        shapes, ([1, 4097, 37, 1500, 64, 3000, 2, 777], [513], [8191])
    ):
        k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
        kv = torch.tensor(kv_lens, device=DEV)
        counter = torch.zeros(len(kv_lens) + 1, kv_heads, device=DEV, dtype=torch.int32)
        for splits, block_n in itertools.product(
            sorted({5, 33, choose_num_splits(len(kv_lens), kv_heads, 132)}), (64, 128)
        ):
            errors = []
            for _ in range(2):  # the second call finds the counter the first one left
                q = torch.randn(len(kv_lens), heads, head_dim, device=DEV, dtype=dtype)
                out = torch.full_like(q, float("nan"))
                decode_attention(
                    q,
                    k_cache,
                    v_cache,
                    r2t,
                    rows,
                    kv,
                    head_dim**-0.5,
                    splits,
                    out=out,
                    block_n=block_n,
                    split_counter=counter,
                )
                errors.append(rel_err(out, decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5)))
            torch.cuda.synchronize()
            errors.append(0.0 if not counter.any() else float("inf"))
            check(
                f"decode merged {heads}/{kv_heads}x{head_dim} {dtype} B={len(kv_lens)} L<={max(kv_lens)} "
                f"splits={splits} block={block_n} (2 calls, counter reset)",
                max(errors),
                tolerance(dtype),
            )


def test_decode_attention_merged_graph_replays() -> None:
    """One CUDA graph of the merged kernel replayed with new queries and lengths: every replay starts
    from the counter the previous one left."""
    heads, kv_heads, head_dim, max_len = 32, 8, 128, 4096
    k_cache, v_cache, r2t, rows = paged_cache([max_len], kv_heads, head_dim, torch.bfloat16)
    q = torch.randn(1, heads, head_dim, device=DEV, dtype=torch.bfloat16)
    kv = torch.tensor([max_len], device=DEV)
    out = torch.empty_like(q)
    counter = torch.zeros(2, kv_heads, device=DEV, dtype=torch.int32)

    def step():
        decode_attention(
            q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5, 33, out=out, block_n=128, split_counter=counter
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    worst = 0.0
    for kv_len in (513, 514, 4096, 1, 2000, 130):
        q.copy_(torch.randn_like(q))
        kv.fill_(kv_len)
        out.fill_(float("nan"))
        graph.replay()
        worst = max(worst, rel_err(out, decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5)))
    torch.cuda.synchronize()
    check("decode merged bf16 B=1 splits=33: 6 graph replays, lengths 1..4096", worst, 1e-2)
    check("decode merged graph replays: counter back at zero", 0.0 if not counter.any() else float("inf"), 1e-12)


def test_decode_attention_fused_rotary() -> None:
    """Rotary + KV store inside flash-decoding vs the separate rotary_and_kv_store kernel + the reference."""
    from tgi_compat.modeling.config import RopeScaling
    from tgi_compat.modeling.layers.rotary import build_cos_sin

    cos_table, sin_table = build_cos_sin(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 8192)
    for heads, kv_heads in [(32, 8), (28, 4)]:
        for kv_lens in ([513], [1], [8191], [1, 4097, 37, 1500, 64, 3000, 2, 777]):
            for merged in (True, False):
                batch, dtype = len(kv_lens), torch.bfloat16
                k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, 128, dtype)
                kv = torch.tensor(kv_lens, device=DEV)
                slots = r2t[rows, kv - 1].long()
                k_cache[slots], v_cache[slots] = float("nan"), float("nan")
                qkv = torch.randn(batch, (heads + 2 * kv_heads) * 128, device=DEV, dtype=dtype)
                qk = qkv[:, : (heads + kv_heads) * 128].view(batch, heads + kv_heads, 128)
                v = qkv[:, (heads + kv_heads) * 128 :].view(batch, kv_heads, 128)
                positions = (kv - 1).cpu()
                cos, sin = cos_table[positions].to(DEV, dtype), sin_table[positions].to(DEV, dtype)
                k_ref, v_ref = k_cache.clone(), v_cache.clone()
                qk_ref = qk.clone()
                rotary_and_kv_store(qk_ref, v, cos, sin, k_ref, v_ref, slots, heads)
                ref = decode_attention_ref(qk_ref[:, :heads], k_ref, v_ref, r2t, rows, kv, 128**-0.5)
                counter = torch.zeros(batch, kv_heads, device=DEV, dtype=torch.int32) if merged else None
                out = torch.full((batch, heads, 128), float("nan"), device=DEV, dtype=dtype)
                splits = 33 if batch == 1 else choose_num_splits(batch, kv_heads, 132)
                decode_attention(
                    qk[:, :heads],
                    k_cache,
                    v_cache,
                    r2t,
                    rows,
                    kv,
                    128**-0.5,
                    splits,
                    out=out,
                    block_n=128,
                    split_counter=counter,
                    new_token=NewTokenKV(k=qk[:, heads:], v=v, cos=cos, sin=sin, slots=slots),
                )
                name = f"decode fused rotary {heads}/{kv_heads}x128 bf16 B={batch} L<={max(kv_lens)} merged={merged}"
                check(f"{name}: output", rel_err(out, ref), 1e-2)
                check(f"{name}: new k in the cache", rel_err(k_cache[slots], k_ref[slots]), 1e-2)
                same_v = torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
                k_cache[slots] = k_ref[slots]  # everything else must be untouched
                same_k = torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
                check(f"{name}: v and the rest of the cache (exact)", 0.0 if same_v and same_k else float("inf"), 1e-12)


def test_prefill_attention() -> None:
    for heads, kv_heads, head_dim in [(32, 8, 128), (28, 4, 128)]:
        for dtype in (torch.bfloat16, torch.float32):
            q_lens = [1, 300, 1000, 77, 1, 129]
            kv_lens = [1, 300, 1500, 141, 2001, 129]
            k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
            q_len_t = torch.tensor(q_lens, device=DEV)
            q_start = q_len_t.cumsum(0) - q_len_t
            q = torch.randn(sum(q_lens), heads, head_dim, device=DEV, dtype=dtype)
            args = (q, k_cache, v_cache, r2t, rows, q_start, q_len_t, torch.tensor(kv_lens, device=DEV))
            out = torch.full_like(q, float("nan"))
            prefill_attention(*args, max_q_len=max(q_lens), scale=head_dim**-0.5, out=out)
            ref = prefill_attention_ref(*args, scale=head_dim**-0.5)
            check(f"prefill {heads}/{kv_heads}x{head_dim} {dtype}", rel_err(out, ref), tolerance(dtype))


def test_attention_compiles_once_across_split_counts_and_metadata_offsets() -> None:
    """What varies from step to step (the split count, the partial LSEs' strides, metadata views at any offset)
    is not a specialisation key: after the first launch of each kernel variant, new values compile nothing
    (a compile mid-serving stalls every request ~1 s). Split counts 9-16 share stage 2's SPLITS_PAD."""
    from triton import knobs

    compiled: list[str] = []

    def count(*args, **kwargs) -> bool:
        compiled.append(kwargs["fn"].name)
        return False

    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    kv_lens = [1, 4097, 37, 1500, 64, 3000, 2, 777, 5]
    k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
    meta = torch.tensor([0, *kv_lens, *kv_lens], device=DEV)  # one step buffer, read as views at any offset
    scale = head_dim**-0.5
    previous, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, count
    try:
        for step, (batch, splits) in enumerate([(8, 9), (9, 13), (7, 16), (8, 11), (9, 16)]):
            offset = step % 2  # int64 views: 16-byte aligned or not
            kv = meta[1 + offset : 1 + offset + batch]
            q = torch.randn(batch, heads, head_dim, device=DEV, dtype=dtype)
            out = decode_attention(q, k_cache, v_cache, r2t, rows[:batch], kv, scale, splits)
            ref = decode_attention_ref(q, k_cache, v_cache, r2t, rows[:batch], kv, scale)
            check(f"decode batch {batch} splits {splits} offset {offset}", rel_err(out, ref), tolerance(dtype))
            q_lens = meta.new_tensor([3, 1, 20][: 2 + offset])
            n = len(q_lens)
            prefill_meta = torch.cat([meta.new_zeros(offset), q_lens.cumsum(0) - q_lens, q_lens, q_lens + 10])
            starts, lens, kv_after = (prefill_meta[offset + i * n : offset + (i + 1) * n] for i in range(3))
            q = torch.randn(int(q_lens.sum()), heads, head_dim, device=DEV, dtype=dtype)
            args = (q, k_cache, v_cache, r2t, rows[:n], starts, lens, kv_after)
            out = prefill_attention(*args, max_q_len=int(q_lens.max()), scale=scale)
            check(f"prefill offset {offset}", rel_err(out, prefill_attention_ref(*args, scale=scale)), tolerance(dtype))
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    for name in ("_decode_stage1_kernel", "_decode_stage2_kernel", "_prefill_kernel"):
        check(f"{name}: compiles", compiled.count(name), 2, "count")  # at most one (none if compiled before)


def test_backend_compiles_every_mixed_step_decode_variant_at_start() -> None:
    """After TritonAttentionBackend.compile_kernels, a MIXED step's decode rows compile nothing at any batch size."""
    from triton import knobs

    from tgi_compat.modeling.attention.base import AttentionParams, AttentionShape
    from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata

    heads, kv_heads, head_dim, max_rows, dtype = 32, 8, 128, 80, torch.bfloat16
    backend = TritonAttentionBackend(AttentionShape(heads, kv_heads, head_dim, max_rows, 64, torch.device(DEV), dtype))
    kv_cache = (torch.randn(4096, kv_heads, head_dim, device=DEV, dtype=dtype),) * 2
    req_to_token = torch.randint(0, 4096, (max_rows + 1, 64), device=DEV, dtype=torch.int32)
    params = [AttentionParams(head_dim**-0.5), AttentionParams(head_dim**-0.5, sliding_window=16)]
    backend.compile_kernels(kv_cache, req_to_token, params)
    compiled: list[str] = []

    def count(*args, **kwargs) -> bool:
        compiled.append(kwargs["fn"].name)
        return False

    previous, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, count
    try:
        for batch in (1, 3, 16, 17, 33, 47, 80):
            kv_lens = torch.randint(1, 65, (batch,), device=DEV)
            rows = torch.randperm(max_rows, device=DEV)[:batch]
            splits, block_n = backend._num_splits(batch), choose_block_n(batch, kv_heads, backend.num_sms)
            backend.metadata = TritonAttentionMetadata(
                True, req_to_token, rows, rows, kv_lens, kv_lens, rows[:0], 1, splits, block_n
            )
            q = torch.randn(batch, heads, head_dim, device=DEV, dtype=dtype)
            out = backend.forward(q, *kv_cache, params[0])
            ref = decode_attention_ref(q, *kv_cache, req_to_token, rows, kv_lens, head_dim**-0.5)
            check(f"backend decode at batch {batch}", rel_err(out, ref), tolerance(dtype))
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    check("compiles after compile_kernels", len(compiled), 1, "count")


def test_elementwise() -> None:
    dtype = torch.bfloat16
    tokens = 1000
    # kv_store from a fused-qkv view into NaN-poisoned caches
    qkv = torch.randn(tokens, 48 * 128, device=DEV, dtype=dtype)
    k, v = qkv[:, 32 * 128 : 40 * 128].view(tokens, 8, 128), qkv[:, 40 * 128 :].view(tokens, 8, 128)
    slots = torch.randperm(4000, device=DEV)[:tokens]
    caches = [torch.full((4000, 8, 128), float("nan"), device=DEV, dtype=dtype) for _ in range(4)]
    kv_store(k, v, caches[0], caches[1], slots)
    kv_store_ref(k, v, caches[2], caches[3], slots)
    same = torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0)) and torch.equal(
        caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0)
    )
    check("kv_store bf16 (exact)", 0.0 if same else float("inf"), 1e-12)
    # rmsnorm, with and without the fused residual add
    x = torch.randn(tokens, 4096, device=DEV, dtype=dtype)
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(dtype)
    check("rmsnorm bf16", rel_err(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5)), 1e-2)
    res, res_ref = torch.randn_like(x), None
    res_ref = res.clone()
    out = rmsnorm(x, w, 1e-5, residual=res)
    check("rmsnorm+residual bf16", rel_err(out, rmsnorm_ref(x, w, 1e-5, residual=res_ref)), 1e-2)
    check("rmsnorm residual sum bf16", rel_err(res, res_ref), 1e-12)
    # rotary on the q|k view of a fused qkv output, llama3-scaled tables, random positions
    from tgi_compat.modeling.config import RopeScaling
    from tgi_compat.modeling.layers.rotary import build_cos_sin

    cos, sin = build_cos_sin(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 8192)
    cos, sin = cos.to(DEV, dtype), sin.to(DEV, dtype)
    positions = torch.randint(0, 8192, (tokens,), device=DEV)
    qk = qkv[:, : 40 * 128].view(tokens, 40, 128)
    ref = rotary_embedding_ref(qk, cos, sin, positions)
    rotary_embedding(qk, None, cos, sin, positions)
    check("rotary bf16 (q|k view, llama3 tables)", rel_err(qk, ref), 1e-2)
    gate_up = torch.randn(tokens, 2 * 14336, device=DEV, dtype=dtype)
    check("silu_mul bf16", rel_err(silu_mul(gate_up), silu_mul_ref(gate_up)), 1e-2)
    # rotary fused with the KV store (decode: a few tokens), into NaN-poisoned caches
    qkv = torch.randn(8, 48 * 128, device=DEV, dtype=dtype)
    qk, v = qkv[:, : 40 * 128].view(8, 40, 128), qkv[:, 40 * 128 :].view(8, 8, 128)
    cos8, sin8 = cos[positions[:8]].contiguous(), sin[positions[:8]].contiguous()
    qk_ref = rotary_embedding_ref(qk, cos8, sin8)
    for cache in caches:
        cache.fill_(float("nan"))
    kv_store_ref(qk_ref[:, 32:], v, caches[2], caches[3], slots[:8])
    rotary_and_kv_store(qk, v, cos8, sin8, caches[0], caches[1], slots[:8], 32)
    check("rotary+kv_store bf16: q|k", rel_err(qk, qk_ref), 1e-2)
    same = all(
        torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in ((caches[0], caches[2]), (caches[1], caches[3]))
    )
    check("rotary+kv_store bf16: caches (exact)", 0.0 if same else float("inf"), 1e-12)
    # one-row GEMV with each fused prologue (Llama-3-8B shapes; the tuning script covers them all)
    x, res = torch.randn(1, 4096, device=DEV, dtype=dtype), torch.randn(1, 4096, device=DEV, dtype=dtype)
    w_qkv = torch.randn(6144, 4096, device=DEV, dtype=dtype) / 64
    summed = torch.empty_like(res)
    out = gemv(x, w_qkv, norm_weight=w, eps=1e-5, residual=res, residual_out=summed)
    ref, ref_summed = gemv_ref(x, w_qkv, norm_weight=w, eps=1e-5, residual=res)
    check("gemv rmsnorm+residual prologue bf16 (6144x4096)", rel_err(out, ref), 1e-2)
    check("gemv residual sum bf16 (exact)", rel_err(summed, ref_summed), 1e-12)
    w_down = torch.randn(4096, 14336, device=DEV, dtype=dtype) / 120
    check(
        "gemv silu_mul prologue bf16 (4096x14336)",
        rel_err(gemv(gate_up[:1], w_down, silu_mul=True), gemv_ref(gate_up[:1], w_down, silu_mul=True)[0]),
        1e-2,
    )
    check("gemv plain bf16 (4096x4096)", rel_err(gemv(x, w_qkv[:4096]), gemv_ref(x, w_qkv[:4096])[0]), 1e-2)
    # Gemma 2/3's sandwich norms (Gemma-2-9B shapes): x's norm, the residual add and the next norm
    o, res = 8 * torch.randn(5, 3584, device=DEV, dtype=dtype), torch.randn(5, 3584, device=DEV, dtype=dtype)
    w1, w2 = ((1 + 0.1 * torch.randn(3584, device=DEV)).to(dtype) for _ in range(2))
    summed, res_ref = torch.full_like(res, float("nan")), res.clone()
    out = norm_add_rmsnorm(o, w1, 1e-6, res, w2, 1e-6, residual_out=summed)
    ref = norm_add_rmsnorm_ref(o, w1, 1e-6, res_ref, w2, 1e-6)
    check("norm_add_rmsnorm bf16 (5x3584)", rel_err(out, ref), 1e-2)
    # the sums hold x's normed values rounded to bf16 before the add, as the unfused ops store them
    check_bits("norm_add_rmsnorm residual sum bf16", summed, res_ref)
    # Gemma 3 / Qwen3's per-head q and k norms, in place on the q|k view of a qkv output (64 tokens)
    qkv = torch.randn(64, 48 * 128, device=DEV, dtype=dtype)
    qk = qkv[:, : 40 * 128].view(64, 40, 128)
    q_w, k_w = ((1 + 0.1 * torch.randn(128, device=DEV)).to(dtype) for _ in range(2))
    ref = qk_rmsnorm_ref(qk, q_w, k_w, 1e-6, 32)
    check("qk_rmsnorm bf16 (32 + 8 heads of 128)", rel_err(qk_rmsnorm(qk, q_w, k_w, 1e-6, 32), ref), 1e-2)
    w_gate_up = torch.randn(28672, 3584, device=DEV, dtype=dtype) / 60
    summed = torch.full_like(res[:1], float("nan"))
    kwargs = dict(norm_weight=w2, eps=1e-6, residual=res[:1], x_norm_weight=w1, x_eps=1e-6)
    out = gemv(o[:1], w_gate_up, residual_out=summed, **kwargs)
    ref, ref_summed = gemv_ref(o[:1], w_gate_up, **kwargs)
    check("gemv norm_add_norm prologue bf16 (28672x3584)", rel_err(out, ref), 1e-2)
    check_bits("gemv norm_add_norm residual sum bf16", summed, ref_summed)


def test_quantized_gemv() -> None:
    """FP8 / int8 / int4 (groups of 128) weights at 1-8 bf16 rows, each prologue, the default configs."""
    n, k, dtype = 1536, 4096, torch.bfloat16
    weights = {
        "fp8": QuantizedWeight(torch.randn(n, k, device=DEV).to(torch.float8_e4m3fn), torch.rand(n, device=DEV) / 50),
        "fp8 per tensor": QuantizedWeight(
            torch.randn(n, k, device=DEV).to(torch.float8_e4m3fn), torch.tensor(0.01, device=DEV)
        ),
        "int8": QuantizedWeight(
            torch.randint(-128, 128, (n, k), device=DEV, dtype=torch.int8), torch.rand(n, device=DEV) / 500
        ),
        "int4": QuantizedWeight(
            pack_int4(torch.randint(0, 16, (n, k), device=DEV), 128),
            torch.rand(n, k // 128, device=DEV, dtype=dtype) / 50,
            torch.randint(0, 16, (n, k // 128), device=DEV).to(dtype),
            128,
        ),
    }
    norm_weight = 1 + 0.1 * torch.randn(k, device=DEV, dtype=dtype)
    for (name, w), rows in itertools.product(weights.items(), (1, 3, 8)):
        x, res = torch.randn(rows, 2 * k, device=DEV, dtype=dtype), torch.randn(rows, k, device=DEV, dtype=dtype)
        summed = torch.full_like(res, float("nan"))
        check(f"gemv {name} plain, {rows} rows", rel_err(gemv(x[:, :k], w), gemv_ref(x[:, :k], w)[0]), 1e-2)
        out = gemv(x[:, :k], w, norm_weight=norm_weight, eps=1e-5, residual=res, residual_out=summed)
        ref, ref_summed = gemv_ref(x[:, :k], w, norm_weight=norm_weight, eps=1e-5, residual=res)
        check(f"gemv {name} rmsnorm+residual, {rows} rows", rel_err(out, ref), 1e-2)
        check(f"gemv {name} residual sum, {rows} rows (exact)", rel_err(summed, ref_summed), 1e-12)
        check(
            f"gemv {name} silu_mul, {rows} rows",
            rel_err(gemv(x, w, silu_mul=True), gemv_ref(x, w, silu_mul=True)[0]),
            1e-2,
        )


def test_int4_gemv_split_k() -> None:
    """int4 split-K on real concurrent programs: the same bits on every launch (partials added in split order),
    the reference's values, the counters left at zero, in a CUDA graph replayed as well as eagerly; the tile kernel
    at 1 and 8 rows and the one-row kernel (tgi_compat/kernels/gemv/int4_one_row.py)."""
    from tgi_compat.kernels.gemv.types import GemvConfig

    n, k, dtype = 1536, 4096, torch.bfloat16
    w = QuantizedWeight(
        pack_int4(torch.randint(0, 16, (n, k), device=DEV), 128),
        torch.rand(n, k // 128, device=DEV, dtype=dtype) / 50,
        torch.randint(0, 16, (n, k // 128), device=DEV).to(dtype),
        128,
    )
    norm_weight = 1 + 0.1 * torch.randn(k, device=DEV, dtype=dtype)
    tile = dict(block_n=4, block_k=1024, num_warps=1, num_stages=1)
    cases = [(GemvConfig(**tile, split_k=split_k), rows) for split_k, rows in itertools.product((2, 4), (1, 8))]
    cases += [
        (GemvConfig(block_n=16, block_k=2048, num_warps=2, split_k=split_k, one_row=True), 1) for split_k in (2, 4)
    ]
    for config, rows in cases:
        label = f"split_k={config.split_k}{' one-row kernel' if config.one_row else ''}"
        x, res = torch.randn(rows, k, device=DEV, dtype=dtype), torch.randn(rows, k, device=DEV, dtype=dtype)
        summed = torch.empty_like(res)
        fused = dict(norm_weight=norm_weight, eps=1e-5, residual=res, residual_out=summed, config=config)
        first = gemv(x, w, **fused)
        ref = gemv_ref(x, w, norm_weight=norm_weight, eps=1e-5, residual=res)[0]
        check(f"gemv int4 {label}, {rows} rows", rel_err(first, ref), 1e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = gemv(x, w, **fused)
        differ = 0
        for _ in range(100):
            graph.replay()
            differ += not torch.equal(replayed, first)
            differ += not torch.equal(gemv(x, w, **fused), first)
        check(f"gemv int4 {label}, {rows} rows: 200 launches differing from the first", differ, 0.5)
        check(f"gemv int4 {label} counters not zero", int(split_k_counters(x.device, 1).any()), 0.5)


def test_quantized_gemms_above_the_gemv_rows() -> None:
    """The int4 layout's GEMM at 64 rows; the FP8 GEMM's input from the fused RMSNorm + per-token quantization."""
    n, k, rows, dtype = 4096, 4096, 64, torch.bfloat16
    scale = torch.rand(n, k // 128, device=DEV, dtype=dtype) / 50
    zero = torch.randint(0, 16, (n, k // 128), device=DEV).to(dtype)
    packed = pack_int4(torch.randint(0, 16, (n, k), device=DEV), 128)
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    out = dequant_matmul(x, packed, scale, zero, bits=4, group_size=128)
    check("int4 GEMM, 64 rows", rel_err(out, dequant_matmul_ref(x, packed, scale, zero, bits=4, group_size=128)), 1e-2)
    norm_weight, residual = 1 + 0.1 * torch.randn(k, device=DEV, dtype=dtype), torch.randn_like(x)
    q, q_scale = rmsnorm_quant_per_token(x, norm_weight, 1e-5, torch.float8_e4m3fn, residual, torch.empty_like(x))
    q_ref, scale_ref = quant_per_token(rmsnorm(x, norm_weight, 1e-5, residual=residual.clone()), torch.float8_e4m3fn)
    same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(q_scale, scale_ref)
    check(
        "rmsnorm + FP8 per-token quantization, 64 rows (the unfused pair's bits)", 0.0 if same else float("inf"), 1e-12
    )
    # the skinny FP8 GEMM at each decode width it takes, Llama-3-8B's down projection (K not a power of two)
    weight, weight_scale = quantize_weight_per_channel(torch.randn(4096, 14336, device=DEV) / 120)
    for num_rows in (5, 16, 64):
        q, q_scale = quant_per_token(torch.randn(num_rows, 14336, device=DEV, dtype=dtype), torch.float8_e4m3fn)
        out = fp8_gemm(q, q_scale, weight, weight_scale)
        check(
            f"FP8 GEMM, {num_rows} rows (4096x14336)",
            rel_err(out, fp8_gemm_ref(q, q_scale, weight, weight_scale)),
            1e-2,
        )
    config = Fp8GemmConfig(64, 64, 256, 4, 4, split_k=4)  # split-K: the same bits launch after launch
    first = fp8_gemm(q, q_scale, weight, weight_scale, config=config)
    same = all(torch.equal(fp8_gemm(q, q_scale, weight, weight_scale, config=config), first) for _ in range(200))
    check("FP8 GEMM split-K x4: 200 launches identical", 0.0 if same else float("inf"), 1e-12)
    check("FP8 GEMM split-K x4 (4096x14336)", rel_err(first, fp8_gemm_ref(q, q_scale, weight, weight_scale)), 1e-2)
    zeros = not split_k_counters(q.device, 1).any()
    check("FP8 GEMM split-K counters left at zero", 0.0 if zeros else float("inf"), 1e-12)


TINY_FIELDS = dict(max_position_embeddings=1024, initializer_range=0.1, bos_token_id=None, eos_token_id=None)
TINY = {
    "llama": decoder("LlamaForCausalLM", 256, 512, 4, 8, 2, 1000, pad_token_id=0, **TINY_FIELDS),
    "qwen2": decoder("Qwen2ForCausalLM", 224, 512, 3, 7, 1, 1200, pad_token_id=0, **TINY_FIELDS),
}


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEV)
    # an explicit mask: generate would otherwise treat pad-id tokens inside the prompt as padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def explain_mismatch(model, prompts, ours, theirs, runner, max_len) -> None:
    """Where greedy ids diverge from transformers: a near-tie (top-2 margin) or a real logit gap?"""
    for prompt, a, b in zip(prompts, ours, theirs):
        if a == b:
            continue
        step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        context = torch.tensor([prompt + a[:step]], device=DEV)
        with torch.no_grad():
            hf_logits = model(context).logits[0, -1].float()
        _, our_logits = greedy_generate(runner, [prompt + a[:step]], 1, max_len)
        top2 = hf_logits.topk(2).values
        print(
            f"  diverge at step {step} (len {len(prompt)}): ours {a[step]} vs transformers {b[step]}; "
            f"transformers top-2 margin {float(top2[0] - top2[1]):.2e}; logits rel err "
            f"{rel_err(our_logits[0][0], hf_logits):.2e}",
            flush=True,
        )


def test_grammar_mask_read_from_pinned_host_memory() -> None:
    """GrammarMask keeps a GPU step's bitmask in pinned host memory and its kernels read it there (no copy):
    apply + confine on the device give the torch reference's scores, with and without a row index."""
    from tgi_compat.kernels.sampling.grammar_apply import grammar_apply_ref
    from tgi_compat.kernels.sampling.grammar_confine import grammar_confine_ref
    from tgi_compat.router.sampling.grammar import GrammarMask
    from tgi_compat.router.sampling.sampler import SamplingKernels

    kernels = SamplingKernels.for_device(torch.device(DEV))
    vocab, num_words = 128256, 4008
    scores = torch.randn(64, vocab, device=DEV)
    scores[0, ::5], scores[1, 7], scores[2] = float("nan"), float("inf"), float("-inf")
    for row_index in (None, torch.arange(1, 64, 3, dtype=torch.int32)):
        rows = 64 if row_index is None else row_index.numel()
        bitmask = torch.randint(-(2**31), 2**31, (rows, num_words), dtype=torch.int32)
        pinned_index = None if row_index is None else row_index.pin_memory()
        mask = GrammarMask(bitmask.pin_memory(), pinned_index)
        got = kernels.confine_grammar(kernels.apply_grammar(scores.clone(), mask), mask)
        assert not mask.bitmask.is_cuda  # read in place, not copied
        expected = grammar_apply_ref(scores.cpu(), bitmask, row_index)
        expected = grammar_confine_ref(expected, bitmask, row_index)
        same = torch.equal(got.cpu().isnan(), expected.isnan()) and torch.equal(
            got.cpu().nan_to_num(), expected.nan_to_num()
        )
        check(
            f"grammar mask from pinned memory, row index {row_index is not None}", 0.0 if same else 1.0, 0.5, "differs"
        )


def test_greedy_from_vocab_blocks() -> None:
    """The greedy choice from Llama-3's vocabulary in 2 and 4 padded blocks (as vocab-parallel ranks hold it), their
    partials side by side as the gather leaves them: greedy_pick's ids, its logprobs within 2e-5."""
    from tgi_compat.kernels.sampling.greedy_pick import greedy_block_partials, greedy_merge_blocks, greedy_pick_ref

    vocab = 128256
    for rows, ranks, dtype in [
        (1, 2, torch.bfloat16),
        (64, 2, torch.bfloat16),
        (256, 4, torch.bfloat16),
        (8, 2, torch.float32),
    ]:
        logits = (torch.randn(rows, vocab, device=DEV) * 4).to(dtype)
        logits[0, [9, vocab - 1]] = 50.0  # a tie in the first and the last block: the first wins
        padded = -(-vocab // ranks)
        parts = []
        for rank in range(ranks):
            start = min(rank * padded, vocab)
            size = min(padded, vocab - start)
            block = torch.zeros(rows, padded, device=DEV, dtype=dtype)  # the LM head's block, padding columns zero
            block[:, :size] = logits[:, start : start + size]
            parts.append(greedy_block_partials(block[:, :size], start, vocab))
        ids, packed = greedy_merge_blocks(torch.cat(parts, dim=1), vocab)
        ref_ids, ref_packed = greedy_pick_ref(logits)
        name = f"greedy from {ranks} vocab blocks, {rows} rows {dtype}"
        check(f"{name}: ids", float((ids != ref_ids).sum()), 0.5, "differ")
        check(f"{name}: logprobs", (packed[1] - ref_packed[1]).abs().max().item(), 2e-5, "max abs")


def test_greedy_pick() -> None:
    """The all-greedy choice at Llama-3's vocabulary: the torch computation's ids, its logprobs within 2e-5."""
    from tgi_compat.kernels.sampling.greedy_pick import greedy_pick, greedy_pick_ref

    for rows, dtype in [(1, torch.float32), (64, torch.float32), (256, torch.float32), (8, torch.bfloat16)]:
        logits = (torch.randn(rows, 128256, device=DEV) * 4).to(dtype)
        logits[0, [9, 70000]] = 50.0  # a tie in two chunks: the first wins
        ids, packed = greedy_pick(logits)
        ref_ids, ref_packed = greedy_pick_ref(logits)
        check(f"greedy pick {rows} rows {dtype}: ids", float((ids != ref_ids).sum()), 0.5, "differ")
        check(f"greedy pick {rows} rows {dtype}: packed ids", float((packed[0] != ref_packed[0]).sum()), 0.5, "differ")
        check(
            f"greedy pick {rows} rows {dtype}: logprobs",
            (packed[1] - ref_packed[1]).abs().max().item(),
            2e-5,
            "max abs",
        )


def test_vocab_shard_embedding() -> None:
    """The vocab-parallel lookup of one rank's block (tgi_compat.kernels.comm.vocab_embedding): torch's rows and zeros, bit for
    bit, for ids in and out of the block (Llama-3's vocabulary over 2 ranks, the last block padded)."""
    from tgi_compat.kernels.comm.vocab_embedding import vocab_shard_embedding, vocab_shard_embedding_ref

    block = torch.randn(64128, 4096, device=DEV).to(torch.bfloat16)
    ids = torch.randint(0, 128256, (300,), device=DEV)
    for start, size in [(0, 64128), (64128, 64128), (64128, 60000)]:
        got = vocab_shard_embedding(ids, block, start, size)
        same = torch.equal(got, vocab_shard_embedding_ref(ids, block, start, size))
        check(f"vocab shard embedding, block at {start} of {size} rows", 0.0 if same else 1.0, 0.5, "differs")


def test_side_stream_copies() -> None:
    """tgi_compat.router.copy_streams: an upload is ready for the next kernel of the compute stream, a download holds what
    the compute stream's kernels queued before it wrote, though both copies run on side streams (a long kernel
    queued first makes any missing wait visible)."""
    from tgi_compat.router.copy_streams import download, upload

    busy = torch.randn(4096, 4096, device=DEV)
    for _ in range(3):
        _ = busy @ busy  # the compute stream is busy well past the copies' issue
        host = torch.arange(1 << 16, dtype=torch.int64).pin_memory()
        uploaded = upload(host, torch.device(DEV))
        doubled = uploaded * 2  # queued on the compute stream right after the upload
        pinned = torch.empty_like(host).pin_memory()
        download(doubled, pinned).synchronize()
        check("side-stream upload + download", float((pinned != host * 2).sum()), 0.5, "differ")


def test_weight_prefetch_beside() -> None:
    """tgi_compat.kernels.comm.l2_prefetch at sizes that end mid-chunk and past the tensor leaves the tensor as it was, and
    tgi_compat.modeling.layers.weight_prefetch's fork and join record into a CUDA graph whose replays compute what eager does."""
    from tgi_compat.kernels.comm.l2_prefetch import l2_prefetch
    from tgi_compat.modeling.layers.weight_prefetch import weight_prefetched_beside

    weight = torch.randn(4099, 1027, device=DEV, dtype=torch.bfloat16)  # 8,419,346 bytes: no whole chunk at the end
    before = weight.clone()
    for num_bytes in (16, 100, 16384 + 48, 3 << 20, 8 << 20, 1 << 30):
        l2_prefetch(weight, num_bytes)
    torch.cuda.synchronize()
    check("l2 prefetch leaves its tensor", 0.0 if torch.equal(weight, before) else 1.0, 0.5, "changed")
    x = torch.randn(64, 1027, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(64, 4099, device=DEV, dtype=torch.bfloat16)

    def step() -> None:
        with weight_prefetched_beside(weight, x.shape[0]):
            y = x * 2  # the latency-bound work the prefetch runs beside
        out.copy_(y @ weight.T)

    step()
    expected = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    check("weight prefetch in a CUDA graph", 0.0 if torch.equal(out, expected) else 1.0, 0.5, "differs")


def test_end_to_end() -> None:
    max_len, num_new = 256, 24
    gen = torch.Generator().manual_seed(0)
    for name, config in TINY.items():
        torch.manual_seed(1)
        model, hf_config = hf_model(config, torch.float32)
        prompts = [torch.randint(0, config["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40, 1, 113)]
        state = model.state_dict()
        runners = {b: build_runner(hf_config, state, "float32", b, 8, max_len) for b in ("torch", "triton")}
        graphs = capture_graphs(runners["triton"], [1, 2, 8])  # 4 requests replay bucket 8: 4 padding entries
        ids_torch, _ = greedy_generate(runners["torch"], prompts, num_new, max_len)
        ids_triton, _ = greedy_generate(runners["triton"], prompts, num_new, max_len, graphs=graphs)
        ids_eager, _ = greedy_generate(runners["triton"], prompts, num_new, max_len)
        hf_ids = [hf_greedy(model, p, num_new) for p in prompts]
        check(f"e2e {name} fp32 greedy: triton+graphs == torch backend", 0.0 if ids_triton == ids_torch else 1.0, 0.5)
        check(f"e2e {name} fp32 greedy: triton eager == torch backend", 0.0 if ids_eager == ids_torch else 1.0, 0.5)
        check(f"e2e {name} fp32 greedy: torch backend == transformers", 0.0 if ids_torch == hf_ids else 1.0, 0.5)
        if ids_torch != hf_ids:
            explain_mismatch(model, prompts, ids_torch, hf_ids, runners["torch"], max_len)
        # the same through ModelRunner's own graphs (--cuda-graphs), when the runner has the hook
        hooked = build_runner(hf_config, state, "float32", "triton", 8, max_len, graph_sizes=[1, 2, 8])
        if getattr(hooked, "cuda_graphs", None) is None:
            print(f"NOTE e2e {name}: ModelRunner does not capture CUDA graphs itself (no hook)", flush=True)
        else:
            ids_hooked, _ = greedy_generate(hooked, prompts, num_new, max_len)
            check(
                f"e2e {name} fp32 greedy: ModelRunner(--cuda-graphs 1,2,8) == torch backend",
                0.0 if ids_hooked == ids_torch else 1.0,
                0.5,
            )
        del hooked
        # fp32 logits of each prompt alone (batch 1), the truth for the bf16 batch-1 check below
        truth_b1 = [
            greedy_generate(runners["torch"], [p], num_new, max_len, forced=[f])[1] for p, f in zip(prompts, ids_torch)
        ]
        del runners, graphs
        bf16 = {b: build_runner(hf_config, state, "bfloat16", b, 8, max_len) for b in ("torch", "triton")}
        graphs = capture_graphs(bf16["triton"], [2, 6])
        _, logits_torch = greedy_generate(bf16["torch"], prompts, num_new, max_len, forced=ids_torch)
        _, logits_triton = greedy_generate(bf16["triton"], prompts, num_new, max_len, graphs=graphs, forced=ids_torch)
        worst = max(rel_err(a, b) for a, b in zip(logits_triton, logits_torch))
        check(f"e2e {name} bf16 logits triton vs torch backend (worst step)", worst, 2e-2)
        # Batch 1 takes the one-row path (tgi_compat.kernels.gemv.gemv with the norm / silu_mul fused in, which skips
        # two bf16 roundings): judged against fp32 truth, it must be no less exact than the torch
        # backend's bf16 (the direct triton-vs-torch bf16 error is printed beside it).
        graphs1 = capture_graphs(bf16["triton"], [1])
        err_torch = err_triton = direct = 0.0
        for prompt, forced, truth in zip(prompts, ids_torch, truth_b1):
            _, ref = greedy_generate(bf16["torch"], [prompt], num_new, max_len, forced=[forced])
            err_torch = max(err_torch, *(rel_err(a, b) for a, b in zip(ref, truth)))
            for use_graphs in (graphs1, None):
                _, got = greedy_generate(bf16["triton"], [prompt], num_new, max_len, graphs=use_graphs, forced=[forced])
                err_triton = max(err_triton, *(rel_err(a, b) for a, b in zip(got, truth)))
                direct = max(direct, *(rel_err(a, b) for a, b in zip(got, ref)))
        print(
            f"  batch 1 bf16 vs fp32 truth: torch backend {err_torch:.2e}, triton {err_triton:.2e}; "
            f"triton vs torch bf16 {direct:.2e}",
            flush=True,
        )
        check(
            f"e2e {name} bf16 batch-1 triton (one-row GEMV) error vs fp32 / torch backend's",
            err_triton / err_torch,
            1.25,
        )
        del graphs1
        del bf16, graphs, model
        torch.cuda.empty_cache()
