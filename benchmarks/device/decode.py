"""Decode steps of random-weight Llama-3-8B and Qwen2-7B through ModelRunner with CUDA graphs, against their
memory roofline and transformers `generate` on the same GPU and weights.

    python3 -m benchmarks.device.decode [--models llama3-8b,qwen2-7b] [--skip-transformers] [--json FILE]

Steps: every request starts at a CONTEXT-token context of random K/V (no prefill), then STEPS greedy steps
(argmax included) replayed from decode CUDA graphs, timed with CUDA events; a per-kernel profile of one eager
step at batch 1 and 256. Roofline floor = (weights read per step, embedding excluded + batch x KV bytes of the
mean context) / copy bandwidth. transformers: `generate` (greedy, `min_new_tokens` forcing the length) from a
CONTEXT-token prompt, (t(HF_STEPS + 1 new tokens) - t(1 new token)) / HF_STEPS per step.
`TGI_COMPAT_PDL=0` turns off programmatic dependent launch for an A/B run.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.device.steps import (
    build_runner,
    capture_graphs,
    decode_weight_bytes,
    fill_context,
    hf_model,
    profile_step,
    time_decode,
)
from benchmarks.device.timing import copy_bandwidth, device_info, log, out_path, write_json
from benchmarks.shapes import MODELS

CONTEXT = 512
STEPS = 64
HF_STEPS = 32
BATCHES = [1, 8, 32, 64, 128, 256]


def bench_ours(model, hf_config: dict, bandwidth: float) -> dict:
    max_len = CONTEXT + STEPS + 8
    runner = build_runner(hf_config, model.state_dict(), "bfloat16", "triton", max(BATCHES), max_len)
    fill_context(runner, max(BATCHES), max_len, CONTEXT)
    t0 = time.perf_counter()
    graphs = capture_graphs(runner, BATCHES)
    capture_s = time.perf_counter() - t0
    vocab = hf_config["vocab_size"]
    weights = decode_weight_bytes(runner)
    kv_per_token = runner._kv_bytes_per_token()
    result = dict(capture_s=capture_s, weight_gb=weights / 1e9, kv_bytes_per_token=kv_per_token, batches={})
    eager_ms = time_decode(runner.forward, 1, max_len, vocab, 16, CONTEXT)
    result["batch1_eager_ms"] = eager_ms
    result["profile_b1"] = profile_step(runner.forward, 1, max_len, vocab, CONTEXT)
    result["profile_b256"] = profile_step(runner.forward, 256, max_len, vocab, CONTEXT)
    for batch in BATCHES:
        ms = time_decode(graphs.replay, batch, max_len, vocab, STEPS, CONTEXT)
        moved = weights + batch * (CONTEXT + STEPS // 2) * kv_per_token
        floor_ms = moved / bandwidth * 1e3
        result["batches"][batch] = dict(
            ms_per_step=ms, tok_s=batch * 1e3 / ms, floor_ms=floor_ms, pct_roofline=100 * floor_ms / ms
        )
        log(
            f"ours B={batch:4d}: {ms:7.3f} ms/step {batch * 1e3 / ms:9.0f} tok/s  floor {floor_ms:.3f} ms "
            f"({100 * floor_ms / ms:.1f}% of roofline)"
        )
    log(f"ours B=1 eager (no graphs): {eager_ms:.3f} ms/step; graph capture {capture_s:.1f} s")
    del graphs, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


@torch.inference_mode()
def bench_transformers(model, vocab: int) -> dict:
    """Decode tokens/s of transformers generate: (t(CONTEXT + HF_STEPS + 1 new) - t(1 new)) / HF_STEPS."""
    result = {"attn_implementation": getattr(model.config, "_attn_implementation", None)}
    for batch in BATCHES:
        if batch == 64:
            continue
        ids = torch.randint(0, vocab, (batch, CONTEXT), device="cuda")
        mask = torch.ones_like(ids)

        def run(new: int, ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
            torch.cuda.synchronize()
            return time.perf_counter() - t

        run(2)  # warm-up
        first = run(1)
        full = run(HF_STEPS + 1)
        ms = (full - first) / HF_STEPS * 1e3
        result[batch] = dict(ms_per_step=ms, tok_s=batch * 1e3 / ms)
        log(f"transformers B={batch:4d}: {ms:7.3f} ms/step {batch * 1e3 / ms:9.0f} tok/s")
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3-8b,qwen2-7b")
    parser.add_argument("--json", default=out_path("bench_decode.json"))
    parser.add_argument("--skip-transformers", action="store_true", help="our decode steps only")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    report = dict(device_info(bandwidth), context=CONTEXT, steps=STEPS, hf_steps=HF_STEPS)
    for name in args.models.split(","):
        model, hf_config = hf_model(MODELS[name], torch.bfloat16)
        log(f"--- {name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params")
        report[name] = dict(ours=bench_ours(model, hf_config, bandwidth))
        write_json(args.json, report)
        if not args.skip_transformers:
            report[name]["transformers"] = bench_transformers(model, hf_config["vocab_size"])
        del model
        gc.collect()
        torch.cuda.empty_cache()
        write_json(args.json, report)


if __name__ == "__main__":
    main()
