"""Offline throughput: every request at once, against the server and/or ``transformers`` static batching.

    python -m benchmarks.offline --base-url http://127.0.0.1:3000 --num-prompts 1000 \
        --hf-model /models/llama --hf-batch-size 32 --out-dir bench-offline

With ``--server-cmd "text-generation-launcher --model-id ... --port 3000"`` the server is started for the
server run and stopped before the transformers run, so both get the whole GPU. The comparison (output
tokens/s of each and their ratio) is printed and stored under ``comparison`` in result.json.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

from benchmarks import cli_common as cli
from benchmarks.report import write_report
from benchmarks.runner import RunResult, run_benchmark, warm_up
from benchmarks.serve import print_summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_endpoint_args(parser)
    cli.add_workload_args(parser, default_num=1000)
    server = parser.add_argument_group("server")
    server.add_argument("--server-cmd", default=None, help="start this server for the run, stop it after")
    server.add_argument("--server-startup-timeout", type=float, default=900.0)
    server.add_argument("--no-server", action="store_true", help="transformers baseline only")
    hf = parser.add_argument_group("transformers static batching")
    hf.add_argument("--hf-model", default=None, help="local folder or .gguf; omit to skip the baseline")
    hf.add_argument("--hf-batch-size", type=int, default=32)
    hf.add_argument("--hf-dtype", default="bfloat16")
    hf.add_argument("--hf-device", default=None, help="default: cuda if available, else cpu")
    return parser


def run_server_side(args, samples, opts) -> RunResult:
    if not args.no_warmup_server:
        warm_up(samples, args.backend, opts)
    return run_benchmark(
        samples, args.backend, opts, math.inf, show_progress=not args.no_progress, label="server, all at once"
    )


def run_hf_side(args, samples) -> dict:
    import torch

    from benchmarks.hf_static import load_hf_model, run_static_batching

    device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_hf_model(args.hf_model, args.hf_dtype, device)
    result = run_static_batching(model, tokenizer, samples, args.hf_batch_size, show_progress=not args.no_progress)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {**result.as_dict(), "device": device, "dtype": args.hf_dtype, "model": args.hf_model}


def compare(server_summary: dict | None, hf: dict | None) -> dict:
    comparison: dict = {}
    if server_summary:
        comparison["server_output_tok_per_s"] = server_summary["output_throughput"]
        comparison["server_req_per_s"] = server_summary["request_throughput"]
        comparison["server_duration_s"] = server_summary["duration_s"]
    if hf:
        comparison["hf_static_output_tok_per_s"] = hf["output_throughput"]
        comparison["hf_static_req_per_s"] = hf["request_throughput"]
        comparison["hf_static_duration_s"] = hf["duration_s"]
        comparison["hf_static_slot_efficiency"] = hf["slot_efficiency"]
        comparison["hf_static"] = hf
    if server_summary and hf and hf["output_throughput"] > 0:
        comparison["server_over_hf_output_throughput"] = server_summary["output_throughput"] / hf["output_throughput"]
    return comparison


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--no-warmup-server", action="store_true")
    args = parser.parse_args(argv)
    opts = cli.backend_options(args)
    runs: list[RunResult] = []
    info = None
    if args.no_server:
        samples, tokenizer_id = cli.prepare_workload(args, {"model_id": args.hf_model})
    elif args.server_cmd:
        from benchmarks.server_process import running_server

        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        with running_server(
            args.server_cmd, opts.base_url, args.server_startup_timeout, Path(args.out_dir) / "server.log"
        ):
            info = cli.fetch_info(opts.base_url)
            samples, tokenizer_id = cli.prepare_workload(args, info)
            runs.append(run_server_side(args, samples, opts))
    else:
        info = cli.fetch_info(opts.base_url)
        samples, tokenizer_id = cli.prepare_workload(args, info)
        runs.append(run_server_side(args, samples, opts))
    server_summary = None
    if runs:
        from benchmarks.metrics import summarize

        server_summary = summarize(runs[0].records, runs[0].duration_s)
        print_summary("server, all at once", server_summary)
    hf = run_hf_side(args, samples) if args.hf_model else None
    comparison = compare(server_summary, hf)
    config = {
        "mode": "offline",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": " ".join(sys.argv),
        "base_url": None if args.no_server else opts.base_url,
        "backend": args.backend,
        "server_cmd": args.server_cmd,
        "server_info": info,
        "tokenizer": tokenizer_id,
        "dataset": args.dataset,
        "seed": args.seed,
        "output_len_cap": args.max_output_len,
        "ignore_eos": args.ignore_eos,
        "workload": cli.workload_stats(samples),
        "outputs_may_end_early": True,
    }
    notes = (
        cli.early_stop_note(args)
        + " transformers counts only tokens up to each request's reference length and first EOS."
    )
    write_report(runs, config, notes, Path(args.out_dir), comparison=comparison)
    for key, value in comparison.items():
        if not isinstance(value, dict):
            print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"results: {Path(args.out_dir) / 'result.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
