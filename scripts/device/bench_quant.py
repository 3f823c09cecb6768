"""GPU benchmark of quantization (not CI), one call, random Llama-3-8B weights built on the device:

    PYTHONPATH=$PWD python3 scripts/device/bench_quant.py [--json $OUT/bench_quant.json]

1. decode step time (CUDA graphs, context 512) at batch 1 and 64 for bf16, --quantize fp8, eetq (W8A16)
   and w4a16_int4 (W4A16), the same model and call; ratios to bf16;
2. FP8 KV: KV slots from the same free memory vs bf16 KV, and decode attention at 32k context;
3. each quantization kernel alone at Llama-3-8B's projection shapes, as % of the copy bandwidth;
4. GPU correctness of what the CPU interpreter cannot check: bf16 dequant_matmul, FP8 stores.
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

from kernels.decode_attention import decode_attention
from kernels.dequant_matmul import dequant_matmul, dequant_matmul_ref, pack_int4
from kernels.quant_activation import quant_per_token
from modeling.runner import ModelRunner, RunnerConfig

CONTEXT, STEPS, BATCHES = 512, 64, [1, 64]
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
        f"batch 64 {out['b64_tok_s']:.0f} tok/s")  # fmt: skip
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


def attention_32k(bandwidth: float) -> list[dict]:
    rows = []
    context, heads, kv_heads, dim = 32768, 32, 8, 128
    for batch in (1, 8):
        times = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            k = torch.randn(batch * context + 1, kv_heads, dim, device="cuda").to(dtype)
            v = torch.randn_like(k, dtype=torch.float32).to(dtype)
            req_to_token = torch.arange(batch * context, device="cuda", dtype=torch.int32).view(batch, context)
            rows_t = torch.arange(batch, device="cuda")
            kv_lens = torch.full((batch,), context, device="cuda")
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            ms = graph_ms(lambda: decode_attention(q, k, v, req_to_token, rows_t, kv_lens, 0.088, 64))
            moved = 2 * batch * context * kv_heads * dim * k.element_size()
            times[name] = ms
            rows.append(dict(batch=batch, kv=name, ms=ms, pct_bw=100 * moved / (ms * 1e-3) / bandwidth))
        log(f"decode attention 32k, batch {batch}: bf16 {times['bf16']:.3f} ms, fp8 {times['fp8']:.3f} ms "
            f"({times['bf16'] / times['fp8']:.2f}x)")  # fmt: skip
    return rows


def kernels(bandwidth: float) -> list[dict]:
    rows = []
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        s8 = torch.rand(n, device="cuda") / 100
        w4 = pack_int4(torch.randint(0, 16, (n, k), device="cuda"))
        s4 = torch.rand(n, k // 128, device="cuda", dtype=torch.bfloat16) / 100
        z4 = torch.full_like(s4, 8)
        wf8 = w.to(torch.float8_e4m3fn)
        xq, xs = quant_per_token(x, torch.float8_e4m3fn)
        cases = {
            "bf16 F.linear": (lambda: torch.nn.functional.linear(x, w), 2 * n * k),
            "int8 dequant_matmul": (lambda: dequant_matmul(x, w8, s8, bits=8), n * k),
            "int4 dequant_matmul": (lambda: dequant_matmul(x, w4, s4, z4, bits=4, group_size=128), n * k // 2),
            "fp8 quant_per_token": (lambda: quant_per_token(x, torch.float8_e4m3fn), 3 * k),
            "fp8 _scaled_mm": (
                lambda: torch._scaled_mm(xq, wf8.t(), scale_a=xs, scale_b=s8.view(1, -1), out_dtype=torch.bfloat16),
                n * k,
            ),  # fmt: skip
        }
        for name, (fn, moved) in cases.items():
            ms = graph_ms(fn)
            rows.append(dict(kernel=name, n=n, k=k, us=ms * 1e3, pct_bw=100 * moved / (ms * 1e-3) / bandwidth))
            log(f"  {name:22s} {n:6d}x{k:<6d} {ms * 1e3:8.1f} us  {rows[-1]['pct_bw']:5.1f}% of copy bandwidth")
        ref8 = dequant_matmul_ref(x, w8, s8, bits=8)
        ref4 = dequant_matmul_ref(x, w4, s4, z4, bits=4, group_size=128)
        torch.testing.assert_close(dequant_matmul(x, w8, s8, bits=8), ref8, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dequant_matmul(x, w4, s4, z4, bits=4, group_size=128), ref4, rtol=2e-2, atol=2e-2)
        xq_ref = (x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(xq.float(), xq_ref.float()), "FP8 activation rounding differs from torch's"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_quant.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    report = {"gpu": torch.cuda.get_device_name(), "copy_bw_gbs": bandwidth / 1e9}
    log(f"{report['gpu']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    report["kernels"] = kernels(bandwidth)
    report["attention_32k"] = attention_32k(bandwidth)
    model, hf_config = hf_model(LLAMA3_8B, torch.bfloat16)
    state_dict = {name: t for name, t in model.state_dict().items()}
    report["steps"] = {scheme or "bf16": decode_steps(hf_config, state_dict, scheme) for scheme in SCHEMES}
    base = report["steps"]["bf16"]
    for scheme, row in report["steps"].items():
        log(f"{scheme:>10}: batch 1 {row['b1_ms'] / base['b1_ms']:.2f}x bf16 time, "
            f"batch 64 {row['b64_tok_s'] / base['b64_tok_s']:.2f}x bf16 throughput")  # fmt: skip
    report["kv_capacity"] = kv_capacity(hf_config, state_dict)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
