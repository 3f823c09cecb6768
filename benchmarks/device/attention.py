"""The attention kernels alone at Llama-3-8B's layer shape (32 query / 8 KV heads, head dim 128, bf16).

    python3 -m benchmarks.device.attention [--json FILE]                  # decode bandwidth grid, prefill TFLOP/s
    python3 -m benchmarks.device.attention --cells 32x384,64x384 [--split-counts 1,2,4]   # configs of some cells

Decode attention over batch x context with the backend's split count and key block, its KV reads as % of the
copy bandwidth (slots scattered by a random permutation; K+V bytes + slot indices + q and out counted: a
read-only kernel can pass the read+write copy rate). `--cells`: each batch x context cell over split counts x
block x warps x stages, the rule's config against the best. Prefill: one causal prompt of 1,024 and 4,096 tokens per tile config.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.device.timing import copy_bandwidth, device_info, graph_ms, log, out_path, pct_of, write_json
from benchmarks.shapes import LLAMA3_8B, attention_heads
from tgi_compat.kernels.attention.decode import choose_block_n, choose_num_splits, decode_attention
from tgi_compat.kernels.attention.prefill import prefill_attention

HEADS, KV_HEADS, HEAD_DIM = attention_heads(LLAMA3_8B)
SCALE = HEAD_DIM**-0.5
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 2048, 8192, 32768]


class DecodeCell:
    """One decode-attention measurement point: `batch` requests of `context` tokens each, in slots scattered by
    a random permutation (or contiguous: `scattered=False`)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int, context: int, scattered=True):
        self.k_cache, self.v_cache, self.batch, self.context = k_cache, v_cache, batch, context
        order = torch.randperm(k_cache.shape[0], device="cuda") if scattered else torch.arange(batch * context)
        self.slots = order[: batch * context].view(batch, context).to(device="cuda", dtype=torch.int32)
        self.q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.kv_lens = torch.full((batch,), context, device="cuda")
        self.req_rows = torch.arange(batch, device="cuda")
        self.kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()

    @staticmethod
    def caches(num_slots: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
        return k_cache, torch.randn_like(k_cache, dtype=torch.float32).to(dtype)

    def time_ms(self, splits: int, **config) -> float:
        """Graph-replay time of decode_attention with `splits` and the kernel `config`."""
        out = torch.empty_like(self.q)
        mid_out = torch.empty(self.batch, HEADS, splits, HEAD_DIM, device="cuda")
        mid_lse = torch.empty(self.batch, HEADS, splits, device="cuda")
        launch = functools.partial(
            decode_attention,
            self.q,
            self.k_cache,
            self.v_cache,
            self.slots,
            self.req_rows,
            self.kv_lens,
            SCALE,
            splits,
            out=out,
            mid_out=mid_out,
            mid_lse=mid_lse,
            **config,
        )
        return graph_ms(launch)

    def rule(self) -> tuple[int, int]:
        """The backend's (split count, key block) for this batch on this GPU."""
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return choose_num_splits(self.batch, KV_HEADS, sms), choose_block_n(self.batch, KV_HEADS, sms)


def decode_grid(bandwidth: float) -> list[dict]:
    """Batch x context with the backend's split and block choices."""
    max_tokens = 2 * 2**20
    k_cache, v_cache = DecodeCell.caches(max_tokens)
    rows = []
    for batch, context in itertools.product(BATCHES, CONTEXTS):
        if batch * context > max_tokens:
            continue
        cell = DecodeCell(k_cache, v_cache, batch, context)
        splits, block_n = cell.rule()
        ms = cell.time_ms(splits, block_n=block_n)
        moved = cell.kv_bytes + batch * context * 4 + 2 * cell.q.numel() * 2  # + slot indices, q and out
        row = dict(batch=batch, context=context, splits=splits, block_n=block_n, kv_gb=cell.kv_bytes / 1e9, ms=ms)
        rows.append(row | dict(pct_bw=pct_of(bandwidth, moved, ms)))
        log(
            f"decode-attn B={batch:4d} L={context:6d} splits={splits:3d} block={block_n:3d} "
            f"KV {cell.kv_bytes / 1e9:7.3f} GB {ms * 1e3:9.1f} us  {rows[-1]['pct_bw']:5.1f}% of copy BW"
        )
    return rows


def cells_sweep(bandwidth: float, cells: list[tuple[int, int]], split_counts: list[int] | None) -> list[dict]:
    """Each cell over block size x warps x stages x split counts (default: multiples of the rule's count)."""
    k_cache, v_cache = DecodeCell.caches(2 * 2**20)
    rows = []
    for batch, context in cells:
        cell = DecodeCell(k_cache, v_cache, batch, context)
        base, rule_block = cell.rule()
        counts = split_counts or sorted({max(1, min(128, int(base * scale))) for scale in (0.5, 1, 2, 4)})
        # explicit split counts: a narrower config grid, the split count is the question
        if split_counts:
            grid = itertools.product(counts, (64, 128), (4,), (2, 3))
        else:
            grid = itertools.product(counts, (32, 64, 128), (2, 4, 8), (1, 2, 3, 4))
        cell_rows = []
        for splits, block_n, warps, stages in grid:
            try:
                ms = cell.time_ms(splits, block_n=block_n, num_warps=warps, num_stages=stages)
            except Exception as exc:  # a config Triton cannot build
                log(f"  B={batch} L={context} {block_n}/{warps}/{stages}: {type(exc).__name__}")
                continue
            config = dict(splits=splits, block_n=block_n, warps=warps, stages=stages)
            cell_rows.append(dict(batch=batch, context=context, **config, ms=ms))
            cell_rows[-1]["pct_bw"] = pct_of(bandwidth, cell.kv_bytes, ms)
        best = max(cell_rows, key=lambda r: r["pct_bw"])
        rule = dict(splits=base, block_n=rule_block, warps=4, stages=2)
        default = next((r for r in cell_rows if rule.items() <= r.items()), dict(pct_bw=float("nan")))
        log(
            f"cell B={batch} L={context}: the rule's {default['pct_bw']:.1f}% -> best {best['pct_bw']:.1f}% "
            f"(splits {best['splits']}, block {best['block_n']}, warps {best['warps']}, stages {best['stages']})"
        )
        rows += cell_rows
    return rows


def prefill_tflops() -> list[dict]:
    """One prompt of S tokens; (block_m, block_n, warps, stages) configs, the default first."""
    configs = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2)]
    rows = []
    for seq in (1024, 4096):
        k_cache = torch.randn(seq, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(seq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        r2t = torch.arange(seq, device="cuda", dtype=torch.int32)[None]
        one = torch.zeros(1, dtype=torch.int64, device="cuda")
        lens = torch.full((1,), seq, device="cuda")
        out = torch.empty_like(q)
        for block_m, block_n, warps, stages in configs:
            name = f"prefill-attn S={seq} {block_m}x{block_n} w{warps} s{stages}"
            tiles = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = graph_ms(
                    functools.partial(
                        prefill_attention, q, k_cache, v_cache, r2t, one, one, lens, lens, seq, SCALE, out=out, **tiles
                    )
                )
            except Exception as exc:  # e.g. out of shared memory for a large tile
                log(f"{name}: {type(exc).__name__}")
                continue
            tflops = 4 * HEADS * HEAD_DIM * seq * seq / 2 / (ms * 1e-3) / 1e12  # causal FLOPs
            rows.append(
                dict(seq=seq, block_m=block_m, block_n=block_n, warps=warps, stages=stages, ms=ms, tflops=tflops)
            )
            log(f"{name}: {ms:.3f} ms, {tflops:.0f} TFLOP/s (causal FLOPs)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=out_path("bench_attention.json"))
    parser.add_argument("--cells", default="", help="BxL,BxL,...: only the config sweep of these cells")
    parser.add_argument("--split-counts", default="", help="with --cells: split counts to try, e.g. 2,3,4")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    report = device_info(bandwidth)
    if args.cells:
        cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")]
        counts = [int(v) for v in args.split_counts.split(",") if v] or None
        report["cells"] = cells_sweep(bandwidth, cells, counts)
    else:
        report["decode_attention"] = decode_grid(bandwidth)
        report["prefill_attention"] = prefill_tflops()
    write_json(args.json, report)


if __name__ == "__main__":
    main()
