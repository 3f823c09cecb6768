"""GPU benchmark (not CI), one call: kernels, decode steps through ModelRunner + CUDA graphs, and
transformers `generate` on the same GPU for the same random-weight models of real shapes.

Run on the device:  PYTHONPATH=$PWD python3 scripts/device/bench_gpu.py [--models llama3-8b,qwen2-7b] [--json FILE]

Method: kernel times are medians of triton.testing.do_bench (L2 flushed before each run); the copy
bandwidth is a 2 GiB device-to-device copy counting bytes read + written. Decode steps start from a
context of CONTEXT tokens whose K/V are random values written straight into the cache (no prefill),
and are timed with CUDA events over STEPS consecutive steps. Weights are random (no files).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))

from common import LLAMA3_8B, QWEN2_7B, build_runner, capture_graphs, decode_batch, hf_model

from tgi_compat.kernels.attention.decode import choose_block_n, choose_num_splits, decode_attention
from tgi_compat.kernels.attention.decode_rotary import NewTokenKV
from tgi_compat.kernels.attention.prefill import prefill_attention
from tgi_compat.kernels.attention.rotary import rotary_and_kv_store

DEV = "cuda"
CONTEXT = 512
STEPS = 64
HF_STEPS = 32
BATCHES = [1, 8, 32, 64, 128, 256]
MODELS = {"llama3-8b": LLAMA3_8B, "qwen2-7b": QWEN2_7B}


def log(msg: str) -> None:
    print(msg, flush=True)


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, read + write counted."""
    src = torch.randn(2**30 // 2, device=DEV, dtype=torch.bfloat16).repeat(2)  # 2 GiB
    dst = torch.empty_like(src)
    ms = median_ms(functools.partial(dst.copy_, src))
    return 2 * 2**31 / (ms * 1e-3)


def graph_ms(fn) -> float:
    """Median time of fn captured as a CUDA graph: no host launch cost in the number (METHOD.md)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


class DecodeCell:
    """One decode-attention measurement point, Llama-3-8B layer shape (32 q heads, 8 KV heads, d 128,
    bf16): `batch` requests of `context` tokens each, at slots scattered by a random permutation."""

    HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int, context: int):
        self.k_cache, self.v_cache, self.batch, self.context = k_cache, v_cache, batch, context
        self.slots = (
            torch.randperm(k_cache.shape[0], device=DEV)[: batch * context].view(batch, context).to(torch.int32)
        )
        self.q = torch.randn(batch, self.HEADS, self.HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        self.kv_lens = torch.full((batch,), context, device=DEV)
        self.req_rows = torch.arange(batch, device=DEV)
        self.kv_bytes = batch * context * self.KV_HEADS * self.HEAD_DIM * 2 * 2

    @classmethod
    def caches(cls, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = torch.randn(num_slots, cls.KV_HEADS, cls.HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        return k_cache, torch.randn_like(k_cache)

    def time_ms(self, splits: int, **config) -> float:
        """Graph-replay time of tgi_compat.kernels.attention.decode with `splits` and the kernel `config`."""
        out = torch.empty_like(self.q)
        mid_out = torch.empty(self.batch, self.HEADS, splits, self.HEAD_DIM, device=DEV)
        mid_lse = torch.empty(self.batch, self.HEADS, splits, device=DEV)
        return graph_ms(
            lambda: decode_attention(
                self.q,
                self.k_cache,
                self.v_cache,
                self.slots,
                self.req_rows,
                self.kv_lens,
                0.088,
                splits,
                out=out,
                mid_out=mid_out,
                mid_lse=mid_lse,
                **config,
            )
        )

    def time_attention_side_ms(self, splits: int, merged: bool, fused_rotary: bool, block_n: int) -> float:
        """Graph-replay time of a layer's attention side from an unrotated q|k|v: the rotary + KV-store
        kernel then flash-decoding (two-kernel or merged splits), or all of it in one fused launch."""
        heads, kv_heads, dim = self.HEADS, self.KV_HEADS, self.HEAD_DIM
        qkv = torch.randn(self.batch, heads + 2 * kv_heads, dim, device=DEV, dtype=torch.bfloat16)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        angles = torch.rand(self.batch, dim // 2, device=DEV) * 6.3
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        new_slots = self.slots[:, -1].long()
        out = torch.empty_like(self.q)
        mid_out = torch.empty(self.batch, heads, splits, dim, device=DEV)
        mid_lse = torch.empty(self.batch, heads, splits, device=DEV)
        counter = torch.zeros(self.batch, kv_heads, device=DEV, dtype=torch.int32) if merged else None
        new_token = NewTokenKV(k=qk[:, heads:], v=v, cos=cos, sin=sin, slots=new_slots) if fused_rotary else None

        def layer_attention():
            if not fused_rotary:
                rotary_and_kv_store(qk, v, cos, sin, self.k_cache, self.v_cache, new_slots, heads)
            decode_attention(
                qk[:, :heads],
                self.k_cache,
                self.v_cache,
                self.slots,
                self.req_rows,
                self.kv_lens,
                0.088,
                splits,
                out=out,
                mid_out=mid_out,
                mid_lse=mid_lse,
                block_n=block_n,
                split_counter=counter,
                new_token=new_token,
            )

        return graph_ms(layer_attention)

    def kv_pct_bw(self, ms: float, bandwidth: float) -> float:
        """KV bytes read as % of the copy bandwidth."""
        return 100 * self.kv_bytes / (ms * 1e-3) / bandwidth


def decode_attention_sweep(bandwidth: float) -> list[dict]:
    """Llama-3-8B layer shape over batch x context, with the backend's split and block choices."""
    max_tokens = 2 * 2**20
    k_cache, v_cache = DecodeCell.caches(max_tokens)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in BATCHES:
        for context in (512, 2048, 8192, 32768):
            if batch * context > max_tokens:
                continue
            cell = DecodeCell(k_cache, v_cache, batch, context)
            splits = choose_num_splits(batch, DecodeCell.KV_HEADS, sms)  # the backend's choices
            block_n = choose_block_n(batch, DecodeCell.KV_HEADS, sms)
            ms = cell.time_ms(splits, block_n=block_n)
            moved = cell.kv_bytes + batch * context * 4 + 2 * cell.q.numel() * 2  # + slot indices, q and out
            rows.append(
                dict(
                    batch=batch,
                    context=context,
                    splits=splits,
                    block_n=block_n,
                    kv_gb=cell.kv_bytes / 1e9,
                    ms=ms,
                    pct_bw=100 * moved / (ms * 1e-3) / bandwidth,
                )
            )
            log(
                f"decode-attn B={batch:4d} L={context:6d} splits={splits:3d} block={block_n:3d} "
                f"KV {cell.kv_bytes / 1e9:7.3f} GB {ms * 1e3:9.1f} us  {rows[-1]['pct_bw']:5.1f}% of copy BW"
            )
    del k_cache, v_cache
    return rows


def decode_config_sweep(bandwidth: float) -> list[dict]:
    """Block size / warps / stages of the decode kernel on three shapes; the defaults are block 64, 4 warps, 2 stages."""
    shapes = [(1, 32768), (32, 2048), (256, 1024)]
    k_cache, v_cache = DecodeCell.caches(256 * 1024 + 1)
    # (block_n, warps, stages); the first is the default
    configs = [(64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (64, 8, 2)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context in shapes:
        cell = DecodeCell(k_cache, v_cache, batch, context)
        for split_scale in (1, 2):
            splits = min(64, split_scale * choose_num_splits(batch, DecodeCell.KV_HEADS, sms))
            for block_n, warps, stages in configs:
                ms = cell.time_ms(splits, block_n=block_n, num_warps=warps, num_stages=stages)
                pct = cell.kv_pct_bw(ms, bandwidth)
                rows.append(
                    dict(
                        batch=batch,
                        context=context,
                        splits=splits,
                        block_n=block_n,
                        warps=warps,
                        stages=stages,
                        ms=ms,
                        pct_bw=pct,
                    )
                )
                log(
                    f"decode-cfg B={batch} L={context} splits={splits} block={block_n} warps={warps} "
                    f"stages={stages}: {ms * 1e3:.1f} us {pct:.1f}%"
                )
    del k_cache, v_cache
    return rows


MISSED_CELLS = [(8, 8192), (8, 32768), (32, 2048), (128, 512)]  # < 80% of copy BW in run E


def decode_missed_cells_sweep(
    bandwidth: float, cells: list[tuple[int, int]] = MISSED_CELLS, split_counts: list[int] | None = None
) -> list[dict]:
    """Cells over block size x warps x stages x split counts (default: multiples of the rule's count)."""
    kv_heads = DecodeCell.KV_HEADS
    k_cache, v_cache = DecodeCell.caches(2 * 2**20)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context in cells:
        cell = DecodeCell(k_cache, v_cache, batch, context)
        base = choose_num_splits(batch, kv_heads, sms)
        best = None
        counts = split_counts or sorted({max(1, min(128, int(base * scale))) for scale in (0.5, 1, 2, 4)})
        # explicit split counts: a narrower config grid, the split count is the question
        grid = (
            itertools.product(counts, (64, 128), (4,), (2, 3))
            if split_counts
            else itertools.product(counts, (32, 64, 128), (2, 4, 8), (1, 2, 3, 4))
        )
        for splits, block_n, warps, stages in grid:
            try:
                ms = cell.time_ms(splits, block_n=block_n, num_warps=warps, num_stages=stages)
            except Exception as exc:  # a config Triton cannot build
                log(f"  B={batch} L={context} {block_n}/{warps}/{stages}: {type(exc).__name__}")
                continue
            row = dict(
                batch=batch,
                context=context,
                splits=splits,
                block_n=block_n,
                warps=warps,
                stages=stages,
                ms=ms,
                pct_bw=cell.kv_pct_bw(ms, bandwidth),
            )
            rows.append(row)
            if best is None or row["pct_bw"] > best["pct_bw"]:
                best = row
        default = next(
            (
                r
                for r in rows
                if r["batch"] == batch
                and r["context"] == context
                and r["splits"] == base
                and r["block_n"] == choose_block_n(batch, kv_heads, sms)
                and (r["warps"], r["stages"]) == (4, 2)
            ),
            dict(pct_bw=float("nan")),
        )
        log(
            f"cell B={batch} L={context}: the rule's {default['pct_bw']:.1f}% -> best {best['pct_bw']:.1f}% "
            f"(splits {best['splits']}, block {best['block_n']}, warps {best['warps']}, stages {best['stages']})"
        )
    del k_cache, v_cache
    return rows


SPLIT_SWEEP_SHAPES = [(1, 8192), (1, 32768), (8, 8192), (8, 32768), (32, 2048), (32, 8192), (128, 512), (64, 2048)]
SHORT_SWEEP_SHAPES = [(8, 512), (32, 512), (64, 512), (128, 512), (8, 1024), (32, 1024), (64, 1024), (256, 512)]


def decode_splits_sweep(bandwidth: float, shapes: list[tuple[int, int]], block_n: int = 64) -> list[dict]:
    """How many KV splits per (request, KV head): multiples of the current rule (~4 waves of programs)."""
    k_cache, v_cache = DecodeCell.caches(2**20 + 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context in shapes:
        cell = DecodeCell(k_cache, v_cache, batch, context)
        base = choose_num_splits(batch, DecodeCell.KV_HEADS, sms)
        cells = []
        for splits in sorted({max(1, min(256, int(base * scale))) for scale in (0.25, 0.5, 1, 2, 4, 8)}):
            ms = cell.time_ms(splits, block_n=block_n)
            pct = cell.kv_pct_bw(ms, bandwidth)
            rows.append(dict(batch=batch, context=context, splits=splits, block_n=block_n, ms=ms, pct_bw=pct))
            cells.append(f"{splits}:{pct:.0f}%/{ms * 1e3:.0f}us")
        log(f"decode-splits block={block_n} B={batch} L={context}: " + "  ".join(cells))
    del k_cache, v_cache
    return rows


def prefill_attention_tflops() -> list[dict]:
    """One prompt of S tokens, Llama-3-8B layer shape; (block_m, block_n, warps, stages) configs, default first."""
    heads, kv_heads, head_dim = 32, 8, 128
    configs = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2)]
    rows = []
    for seq in (1024, 4096):
        k_cache = torch.randn(seq, kv_heads, head_dim, device=DEV, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(seq, heads, head_dim, device=DEV, dtype=torch.bfloat16)
        r2t = torch.arange(seq, device=DEV, dtype=torch.int32)[None]
        one = torch.zeros(1, dtype=torch.int64, device=DEV)
        lens = torch.full((1,), seq, device=DEV)
        out = torch.empty_like(q)
        for block_m, block_n, warps, stages in configs:
            try:
                # partial binds this iteration's tensors and tile config (graph_ms runs it before the loop moves on)
                launch = functools.partial(
                    prefill_attention,
                    q,
                    k_cache,
                    v_cache,
                    r2t,
                    one,
                    one,
                    lens,
                    lens,
                    seq,
                    0.088,
                    out=out,
                    block_m=block_m,
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                )
                ms = graph_ms(launch)
            except Exception as exc:  # e.g. out of shared memory for a large tile
                log(f"prefill-attn S={seq} {block_m}x{block_n} w{warps} s{stages}: {type(exc).__name__}")
                continue
            flops = 4 * heads * head_dim * seq * seq / 2  # causal
            rows.append(
                dict(
                    seq=seq,
                    block_m=block_m,
                    block_n=block_n,
                    warps=warps,
                    stages=stages,
                    ms=ms,
                    tflops=flops / (ms * 1e-3) / 1e12,
                )
            )
            log(
                f"prefill-attn S={seq} {block_m}x{block_n} w{warps} s{stages}: {ms:.3f} ms, "
                f"{rows[-1]['tflops']:.0f} TFLOP/s (causal FLOPs)"
            )
    return rows


def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Every parameter is read once per decode step except the embedding table (gathered)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    return total - embed.numel() * embed.element_size()


def fill_context(runner, batch: int, max_len: int, context: int = CONTEXT) -> None:
    """Rows 0..batch-1 hold `context` tokens each in slots i * max_len + pos, with random K/V."""
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    positions = torch.arange(context, device=DEV, dtype=torch.int32)
    rows = torch.arange(batch, device=DEV, dtype=torch.int32)[:, None]
    runner.req_to_token[:batch, :context] = rows * max_len + positions


def time_decode(step, batch: int, max_len: int, vocab: int, steps: int, context: int = CONTEXT) -> float:
    """Milliseconds per decode step over `steps` greedy steps from a `context`-token context."""
    ids = torch.randint(0, vocab, (batch,), device=DEV)
    kv_lens = torch.full((batch,), context + 1, device=DEV)
    batches = [decode_batch(ids, kv_lens + i, max_len) for i in range(steps)]
    for b in batches[:3]:
        step(b)  # warm-up (same positions are rewritten below)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for b in batches:
        step(b).argmax(-1)  # greedy "sampling" cost included; inputs were prebuilt on the device
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def profile_step(step, batch: int, max_len: int, vocab: int) -> list[dict]:
    """GPU time per kernel name for one eager decode step (summed over 4 steps / 4)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (batch,), device=DEV)
    kv_lens = torch.full((batch,), CONTEXT + 1, device=DEV)
    step(decode_batch(ids, kv_lens, max_len))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            step(decode_batch(ids, kv_lens, max_len))
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        device_us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if device_us > 0 and evt.count > 0:
            rows.append(dict(kernel=evt.key[:90], us_per_step=device_us / 4, calls_per_step=evt.count / 4))
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    log(f"profile B={batch} eager step: {total / 1e3:.3f} ms of kernel time per step")
    for r in rows[:14]:
        log(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.0f}  {r['kernel']}")
    return rows[:25]


def bench_ours(model, hf_config: dict, bandwidth: float) -> dict:
    max_len = CONTEXT + STEPS + 8
    runner = build_runner(hf_config, model.state_dict(), "bfloat16", "triton", max(BATCHES), max_len)
    fill_context(runner, max(BATCHES), max_len)
    t0 = time.perf_counter()
    graphs = capture_graphs(runner, BATCHES)
    capture_s = time.perf_counter() - t0
    vocab = hf_config["vocab_size"]
    weights = weight_bytes_read_per_step(model)
    kv_per_token = runner._kv_bytes_per_token()
    result = dict(capture_s=capture_s, weight_gb=weights / 1e9, kv_bytes_per_token=kv_per_token, batches={})
    eager_ms = time_decode(runner.forward, 1, max_len, vocab, 16)
    result["batch1_eager_ms"] = eager_ms
    result["profile_b1"] = profile_step(runner.forward, 1, max_len, vocab)
    result["profile_b256"] = profile_step(runner.forward, 256, max_len, vocab)
    for batch in BATCHES:
        ms = time_decode(graphs.replay, batch, max_len, vocab, STEPS)
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


def batch1_split_sweep(model, hf_config: dict, split_counts: list[int], contexts: list[int]) -> list[dict]:
    """Batch-1 decode step (CUDA graph) with the flash-decoding split count forced, per context."""
    max_len = max(contexts) + STEPS + 8
    runner = build_runner(hf_config, model.state_dict(), "bfloat16", "triton", 1, max_len)
    fill_context(runner, 1, max_len, max(contexts))
    rows = []
    for splits in split_counts:
        runner.backend._num_splits = lambda batch_size, splits=splits: splits
        graphs = capture_graphs(runner, [1])
        for context in contexts:
            ms = time_decode(graphs.replay, 1, max_len, hf_config["vocab_size"], STEPS, context)
            rows.append(dict(splits=splits, context=context, ms_per_step=ms))
            log(f"B=1 splits {splits:3d} context {context:6d}: {ms:.3f} ms/step")
        del graphs
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows


ATTN_SIDE_VARIANTS = {  # name: (merged splits, fused rotary + KV store)
    "two-kernel": (False, False),
    "two-kernel+rotary": (False, True),
    "merged": (True, False),
    "merged+rotary": (True, True),
}


def attention_side_sweep(batches: list[int], contexts: list[int]) -> list[dict]:
    """Rotary + KV store + flash-decoding of one Llama-3-8B layer, each variant, backend split/block rules."""
    k_cache, v_cache = DecodeCell.caches(max(batches) * max(contexts) + 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context in itertools.product(batches, contexts):
        cell = DecodeCell(k_cache, v_cache, batch, context)
        splits = choose_num_splits(batch, DecodeCell.KV_HEADS, sms)
        block_n = choose_block_n(batch, DecodeCell.KV_HEADS, sms)
        times = {
            name: cell.time_attention_side_ms(splits, merged, fused, block_n)
            for name, (merged, fused) in ATTN_SIDE_VARIANTS.items()
        }
        rows.append(dict(batch=batch, context=context, splits=splits, block_n=block_n, us=times))
        log(
            f"attn-side B={batch:3d} L={context:5d} splits={splits:2d}: "
            + "  ".join(f"{name} {ms * 1e3:6.2f} us" for name, ms in times.items())
        )
    del k_cache, v_cache
    return rows


STEP_VARIANTS = {  # name: (backend.merged_split_batches, backend.fused_rotary_batches)
    "two-kernel": (range(0), range(0)),
    "two-kernel+rotary": (range(0), range(1, 257)),
    "merged": (range(1, 257), range(0)),
    "merged+rotary": (range(1, 257), range(1, 257)),
}


def attention_step_variants(model, hf_config: dict, batches: list[int], rounds: int = 2) -> list[dict]:
    """Decode steps (CUDA graphs) per batch size with each attention-side variant, rounds interleaved."""
    max_len = CONTEXT + STEPS + 8
    runner = build_runner(hf_config, model.state_dict(), "bfloat16", "triton", max(batches), max_len)
    fill_context(runner, max(batches), max_len)
    rows = []
    for round_index in range(rounds):
        for name, (merged, fused) in STEP_VARIANTS.items():
            runner.backend.merged_split_batches, runner.backend.fused_rotary_batches = merged, fused
            graphs = capture_graphs(runner, batches)
            for batch in batches:
                ms = time_decode(graphs.replay, batch, max_len, hf_config["vocab_size"], STEPS)
                rows.append(dict(variant=name, round=round_index, batch=batch, ms_per_step=ms))
            del graphs
    for batch in batches:
        cells = [
            f"{name} "
            + "/".join(f"{r['ms_per_step']:.3f}" for r in rows if r["variant"] == name and r["batch"] == batch)
            for name in STEP_VARIANTS
        ]
        log(f"step B={batch:4d} ms: " + "   ".join(cells))
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def bench_transformers(model, vocab: int) -> dict:
    """Decode tokens/s of transformers generate: (t(CONTEXT + HF_STEPS + 1 new) - t(1 new)) / HF_STEPS."""
    result = {"attn_implementation": getattr(model.config, "_attn_implementation", None)}
    for batch in BATCHES:
        if batch == 64:
            continue
        ids = torch.randint(0, vocab, (batch, CONTEXT), device=DEV)
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3-8b,qwen2-7b")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_gpu.json"))
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true", help="our decode steps only")
    parser.add_argument("--splits-sweep", action="store_true", help="only the decode split-count sweep")
    parser.add_argument("--missed-cells", action="store_true", help="only the config sweep of run E's missed cells")
    parser.add_argument("--cells", default="", help="with --missed-cells: BxL,BxL,... instead of run E's")
    parser.add_argument("--split-counts", default="", help="with --missed-cells: split counts to try, e.g. 2,3,4")
    parser.add_argument(
        "--b1-splits",
        default="",
        help="only batch-1 steps of the first model with these split "
        "counts forced, e.g. 1,4,33 (contexts from --b1-contexts)",
    )
    parser.add_argument("--b1-contexts", default=str(CONTEXT), help="with --b1-splits: contexts, e.g. 512,2048")
    parser.add_argument(
        "--attn-variants",
        action="store_true",
        help="only the attention-side variants (two-kernel, "
        "merged splits, + fused rotary): one layer's kernels, then decode steps of the first model",
    )
    parser.add_argument("--variant-batches", default="1,2,4,8,16,32,64,128,256", help="with --attn-variants")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    report = dict(
        gpu=torch.cuda.get_device_name(),
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        context=CONTEXT,
        steps=STEPS,
        hf_steps=HF_STEPS,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    report["copy_bw_gbs"] = copy_bandwidth() / 1e9
    log(f"{report['gpu']}: copy bandwidth {report['copy_bw_gbs']:.0f} GB/s")
    bandwidth = report["copy_bw_gbs"] * 1e9
    if args.missed_cells:
        cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",") if c] or MISSED_CELLS
        counts = [int(v) for v in args.split_counts.split(",") if v] or None
        report["missed_cells"] = decode_missed_cells_sweep(bandwidth, cells, counts)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        return
    if args.splits_sweep:
        report["decode_splits"] = decode_splits_sweep(bandwidth, SHORT_SWEEP_SHAPES, 64)
        report["decode_splits"] += decode_splits_sweep(bandwidth, SHORT_SWEEP_SHAPES, 32)
        report["decode_splits"] += decode_splits_sweep(bandwidth, SPLIT_SWEEP_SHAPES[2:6], 32)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        return
    if args.attn_variants:
        if not args.skip_kernels:
            report["attn_side"] = attention_side_sweep([1, 2, 4, 8, 16, 32], [512, 2048, 8192])
        name = args.models.split(",")[0]
        model, hf_config = hf_model(MODELS[name], torch.bfloat16)
        batches = [int(b) for b in args.variant_batches.split(",")]
        report["attn_steps"] = {name: attention_step_variants(model, hf_config, batches)}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        return
    if args.b1_splits:
        name = args.models.split(",")[0]
        model, hf_config = hf_model(MODELS[name], torch.bfloat16)
        counts = [int(v) for v in args.b1_splits.split(",")]
        contexts = [int(v) for v in args.b1_contexts.split(",")]
        report["b1_splits"] = {name: batch1_split_sweep(model, hf_config, counts, contexts)}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        return
    if not args.skip_kernels:
        report["decode_attention"] = decode_attention_sweep(bandwidth)
        report["decode_configs"] = decode_config_sweep(bandwidth)
        report["prefill_attention"] = prefill_attention_tflops()
    for name in filter(None, args.models.split(",")):  # --models "": kernels only
        model, hf_config = hf_model(MODELS[name], torch.bfloat16)
        log(f"--- {name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params")
        report[name] = dict(ours=bench_ours(model, hf_config, bandwidth))
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        if not args.skip_transformers:
            report[name]["transformers"] = bench_transformers(model, hf_config["vocab_size"])
        del model
        gc.collect()
        torch.cuda.empty_cache()
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    log(json.dumps(report))


if __name__ == "__main__":
    main()
