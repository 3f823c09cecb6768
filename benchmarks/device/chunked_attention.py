"""Llama 4's chunked local attention (`attention_chunk_size` 8192, three layers of four) in the Triton kernels at
Llama 4 Scout's attention shape (40 query / 8 KV heads, head dim 128, bf16): each case first against its torch
reference, then timed with the chunk against the same call without it (a global layer): decode attention of B
requests at context L (a chunked layer reads at most the chunk's keys, whatever L), and a prefill chunk of Q tokens
over a cached prefix.

    python3 -m benchmarks.device.chunked_attention               # ~1 min on an H200
    python3 -m benchmarks.device.chunked_attention --device cpu  # the CPU smoke run (tiny shapes, kernels interpreted)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# nothing here imports Triton at module level: the smoke run sets TRITON_INTERPRET first, which Triton reads on import


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    chunk: int
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    prefill: tuple[tuple[int, int], ...]  # (new tokens, context): one request's chunk over its cached prefix


DECODE = ((1, 131072), (8, 32768), (32, 16384), (32, 32768))
SCOUT = Shape(40, 8, 128, 8192, DECODE, ((1024, 9216), (4096, 32768), (8192, 16384)))
TINY = Shape(4, 2, 16, 16, ((1, 70), (3, 40)), ((20, 50),))
# cases up to these sizes are checked against the fp32 reference (its memory grows with them: ~3 GB at the bounds)
CHECKED_DECODE_KEYS, CHECKED_PREFILL_PAIRS = 2**17, 2**24


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        from benchmarks.device.timing import graph_ms

        return graph_ms

    def wall_ms(fn: Callable[[], object]) -> float:  # the smoke run: one interpreted call
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)

    return wall_ms


def paged(batch: int, context: int, shape: Shape, device: str, dtype: torch.dtype):
    """K/V caches with each request's tokens in slots scattered by a random permutation; (k, v, req_to_token, rows)."""
    slots = batch * context
    k_cache = torch.randn(slots, shape.kv_heads, shape.head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    req_to_token = torch.randperm(slots, device=device).view(batch, context).to(torch.int32)
    return k_cache, v_cache, req_to_token, torch.arange(batch, device=device)


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def decode_case(batch: int, context: int, shape: Shape, device: str, dtype: torch.dtype) -> dict:
    from tgi_compat.kernels.attention.decode import (
        choose_block_n,
        choose_num_splits,
        decode_attention,
        decode_attention_ref,
    )

    k_cache, v_cache, r2t, rows = paged(batch, context, shape, device, dtype)
    q = torch.randn(batch, shape.heads, shape.head_dim, device=device).to(dtype)
    kv_lens = torch.full((batch,), context, device=device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    splits = choose_num_splits(batch, shape.kv_heads, sms)
    block_n = choose_block_n(batch, shape.kv_heads, sms) if device == "cuda" else 16
    out = torch.empty_like(q)
    mid_out = torch.empty(batch, shape.heads, splits, shape.head_dim, device=device)
    mid_lse = torch.empty(batch, shape.heads, splits, device=device)
    args = (q, k_cache, v_cache, r2t, rows, kv_lens, shape.head_dim**-0.5)

    def run(chunk: int | None) -> torch.Tensor:
        options = dict(out=out, mid_out=mid_out, mid_lse=mid_lse, block_n=block_n, attention_chunk=chunk)
        return decode_attention(*args, splits, **options)

    result = dict(kind="decode", batch=batch, context=context, splits=splits)
    if batch * context <= CHECKED_DECODE_KEYS:
        result["rel_diff"] = rel_diff(run(shape.chunk), decode_attention_ref(*args, attention_chunk=shape.chunk))
    return result | timed(lambda: run(shape.chunk), lambda: run(None), device)


def prefill_case(new: int, context: int, shape: Shape, device: str, dtype: torch.dtype) -> dict:
    from tgi_compat.kernels.attention.prefill import prefill_attention, prefill_attention_ref

    k_cache, v_cache, r2t, rows = paged(1, context, shape, device, dtype)
    q = torch.randn(new, shape.heads, shape.head_dim, device=device).to(dtype)
    one = torch.tensor([new], device=device)
    args = (q, k_cache, v_cache, r2t, rows, torch.zeros_like(one), one, torch.tensor([context], device=device))
    out = torch.empty_like(q)
    blocks = {} if device == "cuda" else dict(block_m=16, block_n=16)

    def run(chunk: int | None) -> torch.Tensor:
        return prefill_attention(*args, new, shape.head_dim**-0.5, out=out, attention_chunk=chunk, **blocks)

    result = dict(kind="prefill", new_tokens=new, context=context)
    if new * context <= CHECKED_PREFILL_PAIRS:
        ref = prefill_attention_ref(*args, shape.head_dim**-0.5, attention_chunk=shape.chunk)
        result["rel_diff"] = rel_diff(run(shape.chunk), ref)
    return result | timed(lambda: run(shape.chunk), lambda: run(None), device)


def timed(chunked: Callable[[], object], global_: Callable[[], object], device: str) -> dict:
    time_ms = timer(device)
    result = dict(chunked_us=1e3 * time_ms(chunked), global_us=1e3 * time_ms(global_))
    result["speedup"] = result["global_us"] / result["chunked_us"]
    print(json.dumps(result), flush=True)
    return result


def table(rows: list[dict], shape: Shape) -> str:
    lines = [
        f"| case (chunk {shape.chunk}) | chunked us | global us | global / chunked | rel diff vs reference |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        case = (
            f"decode B={r['batch']} L={r['context']}"
            if r["kind"] == "decode"
            else f"prefill {r['new_tokens']} over L={r['context']}"
        )
        diff = f"{r['rel_diff']:.1e}" if "rel_diff" in r else "-"
        lines.append(f"| {case} | {r['chunked_us']:.1f} | {r['global_us']:.1f} | {r['speedup']:.2f}x | {diff} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from benchmarks.device.timing import out_path, write_json

    shape, dtype = (SCOUT, torch.bfloat16) if args.device == "cuda" else (TINY, torch.float32)
    torch.manual_seed(0)
    rows = [decode_case(b, length, shape, args.device, dtype) for b, length in shape.decode]
    rows += [prefill_case(n, length, shape, args.device, dtype) for n, length in shape.prefill]
    report = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", cases=rows)
    report["table"] = table(rows, shape)
    print(report["table"], flush=True)
    write_json(args.json or out_path("chunked_attention.json"), report)


if __name__ == "__main__":
    main()
