"""Render bench_gpu.py's JSON as the markdown tables appended to BENCHMARKS.md.

Usage: python scripts/device/render_bench.py bench.json [--commit SHA]
"""

from __future__ import annotations

import argparse
import json


def attention_table(rows: list[dict]) -> list[str]:
    contexts = sorted({r["context"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    cell = {(r["batch"], r["context"]): r for r in rows}
    out = ["| batch \\ context | " + " | ".join(str(c) for c in contexts) + " |", "|---|" + "---|" * len(contexts)]
    for b in batches:
        cells = []
        for c in contexts:
            r = cell.get((b, c))
            cells.append("—" if r is None else f"{r['pct_bw']:.0f}% ({r['ms'] * 1e3:.0f} µs, {r['kv_gb']:.2f} GB)")
        out.append(f"| {b} | " + " | ".join(cells) + " |")
    return out


def model_tables(name: str, data: dict) -> list[str]:
    ours, hf = data["ours"], data.get("transformers", {})
    out = [
        f"**{name}** (weights read per step {ours['weight_gb']:.2f} GB, KV {ours['kv_bytes_per_token']} B/token; "
        f"graph capture {ours['capture_s']:.1f} s; batch-1 eager without graphs {ours['batch1_eager_ms']:.2f} ms/step)",
        "",
        "| batch | ms/step | tok/s | roofline floor ms | % of roofline | transformers ms/step | transformers tok/s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b, r in ours["batches"].items():
        h = hf.get(str(b)) or hf.get(b)
        hf_cells = f"{h['ms_per_step']:.1f} | {h['tok_s']:.0f} | {r['tok_s'] / h['tok_s']:.1f}x" if h else "— | — | —"
        out.append(
            f"| {b} | {r['ms_per_step']:.3f} | {r['tok_s']:.0f} | {r['floor_ms']:.3f} | "
            f"{r['pct_roofline']:.1f}% | {hf_cells} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("json_file")
    parser.add_argument("--commit", default="?")
    args = parser.parse_args()
    with open(args.json_file) as f:
        rep = json.load(f)
    lines = [
        f"GPU {rep['gpu']} ({rep['sms']} SMs), torch {rep['torch']}, triton {rep['triton']}, {rep['date']}, "
        f"commit {args.commit}. Measured copy bandwidth {rep['copy_bw_gbs']:.0f} GB/s (read + write).",
        "",
    ]
    if "decode_attention" in rep:
        lines += [
            "Decode attention (Llama-3-8B layer: 32 q / 8 KV heads, d 128, bf16, slots scattered by a random "
            "permutation), % of copy bandwidth (time, KV bytes per call):",
            "",
        ]
        lines += attention_table(rep["decode_attention"]) + [""]
    if "prefill_attention" in rep:
        lines += [
            "Extend (prefill) attention, one prompt, causal FLOPs: "
            + "; ".join(
                f"S={r['seq']} {r.get('block_m', 64)}x{r.get('block_n', 64)} w{r.get('warps', 4)} s{r.get('stages', 2)}: "
                f"{r['tflops']:.0f} TFLOP/s"
                for r in rep["prefill_attention"]
            ),
            "",
        ]
    for name in ("llama3-8b", "qwen2-7b"):
        if name in rep:
            lines += model_tables(name, rep[name]) + [""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
