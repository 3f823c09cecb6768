"""GPU benchmark of quantization (not CI), one call (~6-8 min on an H100), random Llama-3-8B weights
built on the device:

    PYTHONPATH=$PWD python3 scripts/device/bench_quant.py [--json $OUT/bench_quant.json] [--no-sweep]
        [--parts kernels,attention,steps,kv]

1. each weight format's few-row GEMV (kernels.gemv: bf16, FP8, int8, int4 in groups of 128) at
   Llama-3-8B's four projection shapes, one row, as % of the copy bandwidth: with the prologue the model
   fuses into that projection, the best of a small config sweep (printed at the end of the section),
   2-8 rows, and the path each replaces (cuBLAS, per-token FP8 + _scaled_mm, dequant_matmul); its GPU
   correctness (bf16 activations, 1 and 8 rows, FP8 subnormal weights);
2. FP8 KV: decode attention at 32k context, bf16 vs FP8 KV, with the model backend's split count and
   key block, and the best of a small sweep of each;
3. decode step time (CUDA graphs, context 512) at batch 1, 8 and 64 for bf16, --quantize fp8, eetq (W8A16)
   and w4a16_int4 (W4A16), the same model and call; ratios to bf16;
4. FP8 KV: KV slots from the same free memory vs bf16 KV.
"""

# ruff: noqa: B023  (each lambda is timed inside the loop iteration that defines it)

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_gpu import copy_bandwidth, fill_context, graph_ms, log, time_decode
from common import LLAMA3_8B, capture_graphs, hf_model
from tune_gemv import graph_us

from kernels.decode_attention import choose_block_n, choose_num_splits, decode_attention
from kernels.dequant_matmul import dequant_matmul, dequant_matmul_ref, pack_int4
from kernels.gemv import (
    PROLOGUE_NONE,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    WEIGHT_DENSE,
    WEIGHT_INT4,
    WEIGHT_ROW_SCALED,
    GemvConfig,
    QuantizedWeight,
    gemv,
    gemv_ref,
)
from kernels.quant_activation import quant_per_token, rmsnorm_quant_per_token
from kernels.rmsnorm import rmsnorm
from modeling.attention.triton_backend import MAX_DECODE_SPLITS
from modeling.runner import ModelRunner, RunnerConfig

CONTEXT, STEPS, BATCHES = 512, 64, [1, 8, 64]
SCHEMES = [None, "fp8", "eetq", "w4a16_int4"]


def decode_steps(hf_config: dict, state_dict: dict, quantize: str | None) -> dict:
    max_len = CONTEXT + STEPS + 8
    cfg = RunnerConfig(device="cuda", dtype="bfloat16", attention_backend="triton", num_kv_slots=65 * max_len + 1,
                       max_rows=65, max_seq_len=max_len, show_progress=False, cuda_graph_batch_sizes=[],
                       quantize=quantize)  # fmt: skip
    runner = ModelRunner.from_hf_state_dict(hf_config, state_dict, cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    fill_context(runner, max(BATCHES), max_len)
    graphs = capture_graphs(runner, BATCHES)
    out = {"weight_gb": weight_bytes / 1e9}
    for batch in BATCHES:
        ms = time_decode(graphs.replay, batch, max_len, hf_config["vocab_size"], STEPS)
        out[f"b{batch}_ms"], out[f"b{batch}_tok_s"] = ms, batch * 1e3 / ms
    log(f"{quantize or 'bf16':>10}: weights {out['weight_gb']:.1f} GB, batch 1 {out['b1_ms']:.3f} ms/step, "
        f"batch 8 {out['b8_ms']:.3f} ms/step, batch 64 {out['b64_tok_s']:.0f} tok/s")  # fmt: skip
    del graphs, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def kv_capacity(hf_config: dict, state_dict: dict) -> dict:
    slots = {}
    for kv in (None, "fp8_e4m3fn"):
        cfg = RunnerConfig(device="cuda", dtype="bfloat16", max_rows=64, show_progress=False,
                           cuda_graph_batch_sizes=[], kv_cache_dtype=kv, memory_fraction=0.9)  # fmt: skip
        runner = ModelRunner.from_hf_state_dict(hf_config, state_dict, cfg)
        slots[kv or "bf16"] = runner.num_kv_slots
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    ratio = slots["fp8_e4m3fn"] / slots["bf16"]
    log(f"KV slots in the same memory: bf16 {slots['bf16']}, fp8 {slots['fp8_e4m3fn']} ({ratio:.2f}x)")
    return {"slots": slots, "ratio": ratio}


ATTENTION_SWEEP = [
    (block_n, warps, split_scale) for block_n in (64, 128, 256) for warps in (4, 8) for split_scale in (1, 2)
]


def attention_32k(bandwidth: float) -> list[dict]:
    """Decode attention at 32k context, bf16 vs FP8 KV: with the split count and key block the model's
    backend chooses (4 warps, 2 stages), then the best of a sweep over (block_n, num_warps, splits x1/x2)."""
    rows = []
    context, heads, kv_heads, dim = 32768, 32, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in (1, 8):
        times = {}
        base_splits = choose_num_splits(batch, kv_heads, sms, MAX_DECODE_SPLITS)
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            k = torch.randn(batch * context + 1, kv_heads, dim, device="cuda").to(dtype)
            v = torch.randn_like(k, dtype=torch.float32).to(dtype)
            req_to_token = torch.arange(batch * context, device="cuda", dtype=torch.int32).view(batch, context)
            rows_t = torch.arange(batch, device="cuda")
            kv_lens = torch.full((batch,), context, device="cuda")
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            moved = 2 * batch * context * kv_heads * dim * k.element_size()

            def run(block_n: int, warps: int, splits: int) -> float:
                return graph_ms(lambda: decode_attention(q, k, v, req_to_token, rows_t, kv_lens, 0.088, splits,
                                                         block_n=block_n, num_warps=warps))  # fmt: skip

            model_block = choose_block_n(batch, kv_heads, sms)
            ms = run(model_block, 4, base_splits)
            swept = sorted((run(bn, w, min(64, base_splits * x)), (bn, w, min(64, base_splits * x)))
                           for bn, w, x in ATTENTION_SWEEP)  # fmt: skip
            times[name], times[name + " best"] = ms, swept[0][0]
            for kernel, t, config in (
                ("as the model runs", ms, (model_block, 4, base_splits)),
                ("best swept", *swept[0]),
            ):
                pct = 100 * moved / (t * 1e-3) / bandwidth
                rows.append(dict(batch=batch, kv=name, kernel=kernel, config=config, ms=t, pct_bw=pct))
                log(f"  decode attention 32k batch {batch} {name:4s} {kernel:17s} {t:.4f} ms {pct:5.1f}% of copy "
                    f"bandwidth (block_n, warps, splits) = {config}")  # fmt: skip
        log(f"decode attention 32k, batch {batch}: bf16 {times['bf16']:.3f} ms, fp8 {times['fp8']:.3f} ms "
            f"({times['bf16'] / times['fp8']:.2f}x as the model runs; best swept {times['bf16 best']:.3f} vs "
            f"{times['fp8 best']:.3f} ms, {times['bf16 best'] / times['fp8 best']:.2f}x)")  # fmt: skip
    return rows


SHAPES = {  # Llama-3-8B's projections: (N, K, the prologue the model fuses into each at decode)
    "qkv": (6144, 4096, PROLOGUE_RMSNORM),
    "o": (4096, 4096, PROLOGUE_NONE),
    "gate_up": (28672, 4096, PROLOGUE_RMSNORM),
    "down": (4096, 14336, PROLOGUE_SILU_MUL),
}
FORMATS = {"bf16": WEIGHT_DENSE, "fp8": WEIGHT_ROW_SCALED, "int8": WEIGHT_ROW_SCALED, "int4": WEIGHT_INT4}
GROUP = 128
PROLOGUE_NAMES = {PROLOGUE_NONE: "plain", PROLOGUE_RMSNORM: "rmsnorm+residual", PROLOGUE_SILU_MUL: "silu_mul"}
# GEMV configs swept at one row for the quantized formats (block_n, block_k, num_warps, num_stages[, prefetch[,
# byte_tiles]]),
# with the prologue the model fuses into each projection; bf16 runs its tuned configs (scripts/device/tune_gemv.py
# sweeps those). 1-byte weights want more rows a tile than bf16 for the same bytes in flight; at one row they
# run the 16-bytes-a-thread kernel (kernels.gemv._gemv_bytes_kernel) when byte_tiles is set. The int4 kernel
# spreads a tile's threads over its periods of 128 features (8 periods a warp; a K tile that does not divide K
# is halved until it does); 16 rows a program spill its registers, so the sweep stays at 4-8.
SWEEP = {
    WEIGHT_ROW_SCALED: [(8, 1024, 4, 1), (16, 512, 4, 1), (16, 1024, 4, 1), (16, 1024, 8, 1), (32, 512, 8, 1),
                        (8, 2048, 8, 1), (8, 1024, 4, 1, True), (4, 2048, 4, 1), (32, 1024, 4, 1),
                        (16, 2048, 8, 1), (16, 1024, 4, 1, False, True), (32, 512, 8, 1, False, True),
                        (16, 2048, 8, 1, False, True)],
    WEIGHT_INT4: [(8, 4096, 4, 1), (8, 2048, 2, 1), (8, 2048, 4, 1), (4, 4096, 4, 1), (8, 4096, 8, 1),
                  (4, 2048, 2, 1), (8, 1024, 1, 1), (8, 2048, 2, 1, True)],
}  # fmt: skip
MULTI_ROWS = [2, 4, 8]


def make_weight(fmt: str, n: int, k: int) -> torch.Tensor | QuantizedWeight:
    if fmt == "bf16":
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    if fmt == "int4":
        scale = torch.rand(n, k // GROUP, device="cuda", dtype=torch.bfloat16) / 100
        zero = torch.randint(0, 16, scale.shape, device="cuda").to(torch.bfloat16)
        return QuantizedWeight(pack_int4(torch.randint(0, 16, (n, k), device="cuda"), GROUP), scale, zero, GROUP)
    scale = torch.rand(n, device="cuda") / 100
    if fmt == "fp8":
        return QuantizedWeight(torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn), scale)
    return QuantizedWeight(torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8), scale)


def weight_bytes(w: torch.Tensor | QuantizedWeight) -> int:
    tensors = [w] if isinstance(w, torch.Tensor) else [t for t in (w.data, w.scale, w.zero) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


class GemvCase:
    """Inputs of one shape for every prologue and row count; calls over enough weight copies (> 4x L2)
    that each is read from HBM, as each layer's weights are in a real step."""

    def __init__(self, k: int):
        self.x = torch.randn(max(MULTI_ROWS), 2 * k, device="cuda", dtype=torch.bfloat16)
        self.residual = torch.randn(max(MULTI_ROWS), k, device="cuda", dtype=torch.bfloat16)
        self.summed = torch.empty_like(self.residual)
        self.norm_weight = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
        self.k = k

    def args(self, prologue: int, rows: int) -> tuple[torch.Tensor, dict]:
        if prologue == PROLOGUE_SILU_MUL:
            return self.x[:rows], {"silu_mul": True}
        x = self.x[:rows, : self.k]
        if prologue == PROLOGUE_RMSNORM:
            residual, summed = self.residual[:rows], self.summed[:rows]
            return x, dict(norm_weight=self.norm_weight, eps=1e-5, residual=residual, residual_out=summed)
        return x, {}

    def run(self, w, prologue: int, rows: int = 1, config: GemvConfig | None = None) -> torch.Tensor:
        x, kwargs = self.args(prologue, rows)
        return gemv(x, w, config=config, **kwargs)

    def ref(self, w, prologue: int, rows: int) -> torch.Tensor:
        x, kwargs = self.args(prologue, rows)
        kwargs.pop("residual_out", None)
        return gemv_ref(x, w, **kwargs)[0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def gemv_kernels(bandwidth: float, sweep: bool) -> dict:
    """Per shape and weight format at one row: the GEMV (model's prologue, default config) and the best
    swept config as % of the copy bandwidth, beside the paths they replace; 2-8 rows; GPU correctness."""
    report = {"rows": [], "checks": [], "best_configs": {}}
    for shape, (n, k, prologue) in SHAPES.items():
        case = GemvCase(k)
        for fmt in FORMATS:
            bench_format(report, case, shape, n, prologue, fmt, bandwidth, sweep)
            torch.cuda.empty_cache()
    report["checks"].append(fp8_subnormals_check())
    report["checks"] += many_rows_checks()
    if report["best_configs"]:
        log("best GEMV configs at one row (block_n, block_k, num_warps, num_stages[, prefetch]):")
        for key, config in report["best_configs"].items():
            log(f"  {key:14s} {config}")
    return report


def bench_format(
    report: dict, case: GemvCase, shape: str, n: int, prologue: int, fmt: str, bandwidth: float, sweep: bool
) -> None:
    k = case.k
    w0 = make_weight(fmt, n, k)
    moved = weight_bytes(w0)
    weights = [w0] + [make_weight(fmt, n, k) for _ in range(max(1, -(-200_000_000 // moved)) - 1)]

    def us(fn) -> float:
        return graph_us([lambda w=w: fn(w) for w in weights])

    def record(kernel: str, t_us: float) -> None:
        pct = 100 * moved / (t_us * 1e-6) / bandwidth
        report["rows"].append(dict(shape=shape, n=n, k=k, fmt=fmt, kernel=kernel, us=t_us, pct_bw=pct))
        log(f"  {shape:8s} {fmt:5s} {kernel:40s} {t_us:8.1f} us  {pct:5.1f}% of copy bandwidth")

    for num_rows in (1,) if fmt == "bf16" else (1, max(MULTI_ROWS)):  # plain weights: one row only
        err = rel_err(case.run(w0, prologue, num_rows), case.ref(w0, prologue, num_rows))
        report["checks"].append(dict(shape=shape, fmt=fmt, rows=num_rows, rel_err=err, ok=err <= 1e-2))
        log(f"{'PASS' if err <= 1e-2 else 'FAIL'} gemv {shape} {fmt} {num_rows} row(s): rel err {err:.2e}")
    record(f"gemv + {PROLOGUE_NAMES[prologue]} (as the model runs)", us(lambda w: case.run(w, prologue)))
    if sweep and fmt in ("fp8", "int4"):  # int8 runs the fp8 kernels with int8 bytes
        configs = [GemvConfig(*c) for c in SWEEP[FORMATS[fmt]]]
        timed = sorted(((us(lambda w, c=c: case.run(w, prologue, 1, c)), i) for i, c in enumerate(configs)))
        for t_us, i in timed[:3]:
            record(f"gemv sweep {SWEEP[FORMATS[fmt]][i]}", t_us)
        report["best_configs"][f"{shape} {fmt}"] = SWEEP[FORMATS[fmt]][timed[0][1]]
    if fmt != "bf16":
        for num_rows in MULTI_ROWS:
            record(f"gemv {num_rows} rows", us(lambda w, r=num_rows: case.run(w, PROLOGUE_NONE, r)))
    for num_rows in (1, max(MULTI_ROWS)):  # the path the GEMV replaces, at one row and at the row limit
        x = case.x[:num_rows, :k].contiguous()
        if fmt == "bf16":
            record(f"cuBLAS F.linear {num_rows} rows", us(lambda w, x=x: torch.nn.functional.linear(x, w)))
        elif fmt == "fp8":
            record(f"quant_per_token + _scaled_mm {num_rows} rows", us(lambda w, x=x: scaled_mm(x, w)))
        else:
            bits = 4 if fmt == "int4" else 8
            record(f"dequant_matmul {num_rows} rows", us(lambda w, x=x: dequantizing_matmul(x, w, bits)))


def dequantizing_matmul(x: torch.Tensor, w: QuantizedWeight, bits: int) -> torch.Tensor:
    return dequant_matmul(x, w.data, w.scale, w.zero, bits=bits, group_size=w.group_size)


def scaled_mm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    xq, xs = quant_per_token(x, torch.float8_e4m3fn)
    return torch._scaled_mm(xq, w.data.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16)


def fp8_subnormals_check() -> dict:
    """e4m3 subnormal weights (exponent 0) must not be flushed to zero by the kernel's conversion."""
    codes = torch.randint(1, 8, (64, 4096), device="cuda", dtype=torch.uint8)  # mantissa only
    codes[1::2] |= 0x80  # odd rows negative: each row keeps one sign, so its sum is well conditioned
    w = QuantizedWeight(codes.view(torch.float8_e4m3fn), torch.ones(64, device="cuda"))
    x = torch.ones(1, 4096, device="cuda", dtype=torch.bfloat16)
    err = rel_err(gemv(x, w), gemv_ref(x, w)[0])
    log(f"{'PASS' if err <= 1e-2 else 'FAIL'} gemv fp8 subnormal weights: rel err {err:.2e}")
    return dict(shape="64x4096 subnormal", fmt="fp8", rows=1, rel_err=err, ok=err <= 1e-2)


def many_rows_checks() -> list[dict]:
    """The paths above the GEMV's rows, on the GPU (the CPU interpreter cannot run their bf16 dots): the int4
    GEMM at 64 rows against its dequantized reference; the FP8 GEMM fed by the fused RMSNorm + per-token
    quantization (the same bits as the unfused pair) against the fp32 product of the same FP8 operands."""
    out = []
    n, k, rows = 4096, 4096, 64
    w4 = make_weight("int4", n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    err = rel_err(dequantizing_matmul(x, w4, 4), dequant_matmul_ref(x, w4.data, w4.scale, w4.zero, bits=4,
                                                                  group_size=GROUP))  # fmt: skip
    out.append(dict(shape=f"{n}x{k}", fmt="int4 gemm", rows=rows, rel_err=err, ok=err <= 1e-2))
    w8 = make_weight("fp8", n, k)
    norm_weight, residual = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16), torch.randn_like(x)
    summed = torch.empty_like(x)
    q, scale = rmsnorm_quant_per_token(x, norm_weight, 1e-5, torch.float8_e4m3fn, residual, summed)
    q_ref, scale_ref = quant_per_token(rmsnorm(x, norm_weight, 1e-5, residual=residual.clone()), torch.float8_e4m3fn)
    same = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref))
    out.append(dict(shape=f"{rows}x{k}", fmt="rmsnorm+fp8 quant vs unfused", rows=rows, rel_err=0.0 if same else 1.0,
                    ok=same))  # fmt: skip
    y = torch._scaled_mm(q, w8.data.t(), scale_a=scale, scale_b=w8.scale.view(1, -1), out_dtype=torch.bfloat16,
                         use_fast_accum=True)  # fmt: skip
    ref = (q.float() * scale) @ (w8.data.float() * w8.scale[:, None]).T
    err = rel_err(y, ref)
    out.append(dict(shape=f"{n}x{k}", fmt="fp8 _scaled_mm fast accum", rows=rows, rel_err=err, ok=err <= 1e-2))
    for check in out:
        log(f"{'PASS' if check['ok'] else 'FAIL'} {check['fmt']} {check['rows']} rows: rel err {check['rel_err']:.2e}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_quant.json"))
    parser.add_argument("--no-sweep", action="store_true", help="skip the GEMV config sweep")
    parser.add_argument("--parts", default="kernels,attention,steps,kv", help="comma-separated subset to run")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    report = {"gpu": torch.cuda.get_device_name(), "copy_bw_gbs": bandwidth / 1e9}
    log(f"{report['gpu']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    if "kernels" in parts:
        report["kernels"] = gemv_kernels(bandwidth, sweep=not args.no_sweep)
    if "attention" in parts:
        report["attention_32k"] = attention_32k(bandwidth)
    if parts & {"steps", "kv"}:
        model, hf_config = hf_model(LLAMA3_8B, torch.bfloat16)
        state_dict = {name: t for name, t in model.state_dict().items()}
    if "steps" in parts:
        report["steps"] = {scheme or "bf16": decode_steps(hf_config, state_dict, scheme) for scheme in SCHEMES}
        base = report["steps"]["bf16"]
        for scheme, row in report["steps"].items():
            log(f"{scheme:>10}: batch 1 {row['b1_ms'] / base['b1_ms']:.2f}x bf16 time, batch 8 "
                f"{row['b8_ms'] / base['b8_ms']:.2f}x, batch 64 {row['b64_tok_s'] / base['b64_tok_s']:.2f}x bf16 throughput")  # fmt: skip
    if "kv" in parts:
        report["kv_capacity"] = kv_capacity(hf_config, state_dict)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
