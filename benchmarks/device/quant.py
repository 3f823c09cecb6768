"""Quantization on the GPU, one call (< 8 min on an H100), random Llama-3-8B weights built on the device:

    python3 -m benchmarks.device.quant [--json FILE] [--no-sweep] [--int4-budget-s 150] [--time-limit-s 540]
        [--multi-rows] [--parts kernels,steps,attention,kv] [--schemes bf16,fp8,eetq,w4a16_int4]
        [--fp8-tuned $OUT/fp8_gemm_tuned.json]   (benchmarks.device.fp8_gemm's best configs, for the steps)
        [--profile-b1]   (the decode steps' GPU time per kernel at batch 1)

1. kernels: each weight format's few-row GEMV at Llama-3-8B's projections (benchmarks.device.quant_gemv), then
   the int4 GEMV's config sweep; the best FP8 and int4 configs are installed for the steps below;
2. steps: decode step time (CUDA graphs, context 512) at batch 1, 8 and 64 for bf16, --quantize fp8, eetq (W8A16)
   and w4a16_int4 (W4A16), the same model and call; ratios to bf16;
3. attention: FP8 KV, decode attention at 32k context, bf16 vs FP8 KV, with the backend's split count and key
   block, and the best of a small sweep of each;
4. kv: KV slots from the same free memory, FP8 KV against bf16.
The JSON is rewritten after each part; parts 3 and 4 are skipped when --time-limit-s would be passed.
A SUMMARY block at the end gives the numbers the quantization targets name.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from benchmarks.device.attention import DecodeCell
from benchmarks.device.quant_gemv import gemv_kernels, int4_sweep
from benchmarks.device.steps import build_runner, capture_graphs, fill_context, hf_model, profile_step, time_decode
from benchmarks.device.timing import copy_bandwidth, device_info, log, out_path, pct_of, write_json
from benchmarks.shapes import LLAMA3_8B
from tgi_compat.kernels.gemv import tuned as gemv_tuned
from tgi_compat.kernels.gemv.types import GemvConfig
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

CONTEXT, STEPS, BATCHES = 512, 64, [1, 8, 64]
SCHEMES = [None, "fp8", "eetq", "w4a16_int4"]
ATTENTION_SWEEP = [
    (64, 4, 1),
    (64, 4, 2),
    (128, 4, 1),
    (128, 4, 2),
    (128, 8, 2),
    (256, 8, 1),
]  # block_n, warps, x splits


def decode_steps(hf_config: dict, state_dict: dict, quantize: str | None, profile_b1: bool = False) -> dict:
    max_len, vocab = CONTEXT + STEPS + 8, hf_config["vocab_size"]
    runner = build_runner(hf_config, state_dict, "bfloat16", "triton", max(BATCHES), max_len, quantize=quantize)
    out = {"weight_gb": sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 1e9}
    fill_context(runner, max(BATCHES), max_len, CONTEXT)
    graphs = capture_graphs(runner, BATCHES)
    for batch in BATCHES:
        ms = time_decode(graphs.replay, batch, max_len, vocab, STEPS, CONTEXT)
        out[f"b{batch}_ms"], out[f"b{batch}_tok_s"] = ms, batch * 1e3 / ms
    if profile_b1:  # GPU time per kernel in a batch-1 graph replay (under PDL a kernel's time includes its wait)
        out["profile_b1"] = profile_step(graphs.replay, 1, max_len, vocab, CONTEXT)
    log(
        f"{quantize or 'bf16':>10}: weights {out['weight_gb']:.1f} GB, batch 1 {out['b1_ms']:.3f} ms/step, "
        f"batch 8 {out['b8_ms']:.3f} ms/step, batch 64 {out['b64_tok_s']:.0f} tok/s"
    )
    del graphs, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def kv_capacity(hf_config: dict, state_dict: dict) -> dict:
    slots = {}
    for kv in (None, "fp8_e4m3fn"):
        cfg = RunnerConfig(
            device="cuda",
            dtype="bfloat16",
            max_rows=64,
            show_progress=False,
            cuda_graph_batch_sizes=[],
            kv_cache_dtype=kv,
            memory_fraction=0.9,
        )
        runner = ModelRunner.from_hf_state_dict(hf_config, state_dict, cfg)
        slots[kv or "bf16"] = runner.num_kv_slots
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    ratio = slots["fp8_e4m3fn"] / slots["bf16"]
    log(f"KV slots in the same memory: bf16 {slots['bf16']}, fp8 {slots['fp8_e4m3fn']} ({ratio:.2f}x)")
    return {"slots": slots, "ratio": ratio}


def attention_32k(bandwidth: float) -> list[dict]:
    """Decode attention at 32k context, bf16 vs FP8 KV: with the split count and key block the model's backend
    chooses (4 warps, 2 stages), then the best of a sweep over (block_n, num_warps, splits x1/x2)."""
    rows, context = [], 32768
    for batch in (1, 8):
        times = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            cell = DecodeCell(*DecodeCell.caches(batch * context + 1, dtype), batch, context, scattered=False)
            base_splits, model_block = cell.rule()  # the backend's split count and key block
            configs = [(model_block, 4, base_splits)] + [
                (bn, w, min(64, base_splits * x)) for bn, w, x in ATTENTION_SWEEP
            ]
            timed = {c: cell.time_ms(c[2], block_n=c[0], num_warps=c[1]) for c in configs}
            best = min(timed, key=timed.get)
            times[name], times[name + " best"] = timed[configs[0]], timed[best]
            for kernel, config in (("as the model runs", configs[0]), ("best swept", best)):
                pct = pct_of(bandwidth, cell.kv_bytes, timed[config])
                rows.append(dict(batch=batch, kv=name, kernel=kernel, config=config, ms=timed[config], pct_bw=pct))
                log(
                    f"  decode attention 32k batch {batch} {name:4s} {kernel:17s} {timed[config]:.4f} ms {pct:5.1f}% "
                    f"of copy bandwidth (block_n, warps, splits) = {config}"
                )
        log(
            f"decode attention 32k, batch {batch}: bf16 {times['bf16']:.3f} ms, fp8 {times['fp8']:.3f} ms "
            f"({times['bf16'] / times['fp8']:.2f}x as the model runs; best swept {times['bf16 best']:.3f} vs "
            f"{times['fp8 best']:.3f} ms, {times['bf16 best'] / times['fp8 best']:.2f}x)"
        )
    return rows


def summarize(report: dict) -> dict:
    """The numbers the issue's targets name, in one block at the end of the output (and the JSON's "summary")."""
    out: dict = {}
    steps = report.get("steps", {})
    targets = {"fp8": "b1 <= 0.65x, 64 rows >= 1.3x", "w4a16_int4": "b1 <= 0.45x"}
    for scheme, row in steps.items() if "bf16" in steps else ():
        base = steps["bf16"]
        ratios = dict(b1=row["b1_ms"] / base["b1_ms"], b8=row["b8_ms"] / base["b8_ms"])
        ratios["b64_tok_s"] = row["b64_tok_s"] / base["b64_tok_s"]
        out[f"steps {scheme}"] = dict(b1_ms=row["b1_ms"], **ratios)
        log(
            f"SUMMARY steps {scheme:10s} b1 {row['b1_ms']:.3f} ms ({ratios['b1']:.2f}x bf16), b8 {ratios['b8']:.2f}x, "
            f"64 rows {ratios['b64_tok_s']:.2f}x bf16 tok/s  {targets.get(scheme, '')}"
        )
    for case in report.get("int4_sweep", {}).get("cases", []):
        key = f"int4 gemv {case['shape']} {case['rows']} row(s)"
        out[key] = dict(default_pct_bw=case["default_pct_bw"], best_pct_bw=case["best_pct_bw"], best=case["best"])
        log(f"SUMMARY {key:32s} default {case['default_pct_bw']:3.0f}% of copy BW, best {case['best_pct_bw']:3.0f}%")
    checks = report.get("kernels", {}).get("checks", [])
    failed = [c for c in checks if not c["ok"]]
    out["gpu_checks_failed"] = len(failed)
    log(f"SUMMARY GPU correctness checks: {len(checks) - len(failed)} passed, {len(failed)} failed {failed or ''}")
    attention = {
        (r["batch"], r["kv"]): r["ms"] for r in report.get("attention_32k", []) if r["kernel"] == "as the model runs"
    }
    for batch in (1, 8):
        if (batch, "bf16") in attention and (batch, "fp8") in attention:
            ratio = attention[batch, "bf16"] / attention[batch, "fp8"]
            out[f"attention 32k b{batch} fp8 / bf16 speed"] = ratio
            log(f"SUMMARY decode attention 32k batch {batch}: FP8 KV {ratio:.2f}x bf16 KV (target >= 1.6x)")
    if "kv_capacity" in report:
        log(f"SUMMARY KV slots FP8 / bf16: {report['kv_capacity']['ratio']:.2f}x (target >= 1.9x)")
    return out


def install_tuned(report: dict) -> None:
    """The sweeps' best configs into tgi_compat.kernels.gemv.gemv's tables, so the decode steps below run them."""
    gemv_tuned.TUNED_ROW_SCALED.update(report.get("kernels", {}).get("tuned_row_scaled", {}))
    gemv_tuned.TUNED_INT4.update(report.get("int4_sweep", {}).get("tuned", {}))
    log(
        f"decode steps run {len(gemv_tuned.TUNED_ROW_SCALED)} tuned fp8/int8 and {len(gemv_tuned.TUNED_INT4)} "
        "tuned int4 GEMV configs"
    )


def jsonable(value):
    """The report with tuple keys as strings and configs as dicts."""
    if isinstance(value, dict):
        return {str(k) if isinstance(k, tuple) else k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, GemvConfig):
        return dataclasses.asdict(value)
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=out_path("bench_quant.json"))
    parser.add_argument("--no-sweep", action="store_true", help="skip the GEMV config sweeps")
    parser.add_argument("--int4-budget-s", type=float, default=150.0, help="time for the int4 GEMV sweep")
    parser.add_argument("--time-limit-s", type=float, default=540.0, help="skip the attention / kv parts past it")
    parser.add_argument("--multi-rows", action="store_true", help="time the FP8/int8/int4 GEMVs at 2, 4, 8 rows too")
    parser.add_argument("--parts", default="kernels,steps,attention,kv", help="comma-separated subset to run")
    parser.add_argument("--schemes", default="bf16,fp8,eetq,w4a16_int4", help="the decode steps' schemes (bf16 always)")
    parser.add_argument("--profile-b1", action="store_true", help="the steps' batch-1 GPU time per kernel")
    parser.add_argument("--fp8-tuned", help="benchmarks.device.fp8_gemm's --tuned-out file, installed before the steps")
    args = parser.parse_args()
    if args.fp8_tuned:
        from benchmarks.device.fp8_gemm import install_tuned as install_fp8_gemm_tuned

        install_fp8_gemm_tuned(args.fp8_tuned)
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    started = time.monotonic()
    bandwidth = copy_bandwidth()
    report = device_info(bandwidth)

    def save(part: str) -> None:  # after every part, so a run cut short keeps what it measured
        log(f"[{part} done at {time.monotonic() - started:.0f} s]")
        write_json(args.json, jsonable(report))

    def time_left_for(part: str, seconds: float) -> bool:  # the last parts are skipped rather than cut
        left = args.time_limit_s - (time.monotonic() - started)
        if left < seconds:
            log(f"[{part} skipped: {left:.0f} s left of --time-limit-s, it takes ~{seconds:.0f} s]")
        return left >= seconds

    if "kernels" in parts:
        report["kernels"] = gemv_kernels(bandwidth, sweep=not args.no_sweep, multi_rows=args.multi_rows)
        save("kernels")
        if not args.no_sweep:
            report["int4_sweep"] = int4_sweep(bandwidth, args.int4_budget_s)
            save("int4 sweep")
        install_tuned(report)
    if parts & {"steps", "kv"}:
        model, hf_config = hf_model(LLAMA3_8B, torch.bfloat16)
        state_dict = dict(model.state_dict())
    if "steps" in parts:
        report["steps"] = {}
        for scheme in SCHEMES:
            if scheme is None or scheme in args.schemes.split(","):  # bf16 always: the ratios' base
                report["steps"][scheme or "bf16"] = decode_steps(hf_config, state_dict, scheme, args.profile_b1)
                save(f"steps {scheme or 'bf16'}")
        report["summary"] = summarize(report)  # printed now too, in case the parts below run out of time
    if "attention" in parts and time_left_for("attention", 60):
        report["attention_32k"] = attention_32k(bandwidth)
        save("attention")
    if "kv" in parts and time_left_for("kv", 45):
        report["kv_capacity"] = kv_capacity(hf_config, state_dict)
        save("kv")
    report["summary"] = summarize(report)
    save("summary")


if __name__ == "__main__":
    main()
