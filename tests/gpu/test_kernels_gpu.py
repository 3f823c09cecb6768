"""GPU correctness: the elementwise, GEMV and quantized GEMM kernels vs their references at real shapes (marker `gpu`;
skipped without CUDA, so CI collects and skips them).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu
Thresholds (METHOD.md): relative L2 error vs an fp32 reference; fp32 kernels < 1e-4 (ieee dots),
bf16/fp16 < 1e-2; NaN never passes; outputs are poisoned with NaN before each run. The attention kernels:
test_attention_gpu.py; the runtime pieces and end to end: test_runtime_gpu.py.
"""

from __future__ import annotations

import itertools

import torch

from tests.gpu.kernel_checks import DEV, GPU_ONLY, check, check_bits, every_check_passes, rel_err  # noqa: F401 (every_check_passes: autouse)
from tgi_compat.kernels.attention.kv_store import kv_store, kv_store_ref
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

pytestmark = GPU_ONLY


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
