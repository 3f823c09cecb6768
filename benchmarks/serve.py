"""Online serving benchmark: replay a workload at one or more request rates and report latency/throughput.

    python -m benchmarks.serve --base-url http://127.0.0.1:3000 --request-rate 1,4,16,inf \
        --dataset sharegpt --num-prompts 200 --out-dir bench-results

Works against this server, TGI (``--backend tgi``) or any OpenAI-compatible server (``--backend openai``).
Writes ``result.json``, PNG plots and ``index.html`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from benchmarks.cli_common import (
    add_endpoint_args,
    add_workload_args,
    backend_options,
    early_stop_note,
    fetch_info,
    parse_rates,
    prepare_workload,
    workload_stats,
)
from benchmarks.report import rate_label, write_report
from benchmarks.runner import run_benchmark, warm_up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_endpoint_args(parser)
    add_workload_args(parser, default_num=200)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", default="inf", help="comma-separated requests/s, 'inf' = all at once (e.g. 1,4,16,inf)"
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival gaps; 1 = Poisson")
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (with --request-rate inf: a fixed concurrency)",
    )
    load.add_argument("--timeline-bin", type=float, default=1.0, help="seconds per throughput bin")
    load.add_argument("--no-warmup", action="store_true")
    return parser


def print_summary(label: str, summary: dict) -> None:
    print(
        f"--- {label}: {summary['completed']}/{summary['num_requests']} ok in "
        f"{summary['duration_s']:.2f} s; {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_throughput']:.1f} out tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s, ended early {summary['ended_early']}"
    )
    for key in ("ttft", "tpot", "itl", "e2e"):
        d = summary[key]
        if d["count"]:
            print(
                f"    {key.upper():5s} mean {d['mean_ms']:9.2f}  median {d['median_ms']:9.2f}  "
                f"p90 {d['p90_ms']:9.2f}  p99 {d['p99_ms']:9.2f} ms"
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = backend_options(args)
    info = fetch_info(opts.base_url)
    samples, tokenizer_id = prepare_workload(args, info)
    if not args.no_warmup:
        warm_up(samples, args.backend, opts)
    runs = []
    for rate in parse_rates(args.request_rate):
        run = run_benchmark(
            samples,
            args.backend,
            opts,
            rate,
            args.burstiness,
            args.max_concurrency,
            args.seed,
            show_progress=not args.no_progress,
        )
        runs.append(run)
    config = {
        "mode": "serve",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": " ".join(sys.argv),
        "base_url": opts.base_url,
        "backend": args.backend,
        "endpoint": "/generate_stream" if args.backend == "tgi" else "/v1/completions",
        "server_info": info,
        "tokenizer": tokenizer_id,
        "dataset": args.dataset,
        "seed": args.seed,
        "output_len_cap": args.max_output_len,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "outputs_may_end_early": not (args.ignore_eos and args.backend == "openai"),
        "workload": workload_stats(samples),
    }
    result = write_report(runs, config, early_stop_note(args), Path(args.out_dir), args.timeline_bin)
    for run, run_json in zip(runs, result["runs"]):
        print_summary(rate_label(run), run_json["summary"])
    print(f"results: {Path(args.out_dir) / 'result.json'}, report: {Path(args.out_dir) / 'index.html'}")
    failed = sum(r["summary"]["failed"] for r in result["runs"])
    return 1 if failed and all(r["summary"]["completed"] == 0 for r in result["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
