"""Write a run's results: one JSON file, PNG plots (matplotlib) and a small HTML page embedding them."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import numpy as np

from benchmarks.metrics import RequestRecord, summarize, throughput_timeline
from benchmarks.runner import RunResult

try:  # plots are optional: a machine without matplotlib still gets result.json and the HTML table
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
except ImportError:  # pragma: no cover - depends on the machine
    plt = None

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL (all gaps)"), ("e2e", "E2E latency"))


def rate_label(run: RunResult) -> str:
    rate = "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"
    return f"rate={rate}" + (f", conc={run.max_concurrency}" if run.max_concurrency else "")


def request_row(record: RequestRecord, start: float) -> dict:
    ok = record.ok
    return {
        "prompt_len": record.prompt_len,
        "server_prompt_tokens": record.server_prompt_tokens,
        "max_new_tokens": record.max_new_tokens,
        "output_tokens": record.output_tokens,
        "num_chunks": len(record.chunk_times),
        "finish_reason": record.finish_reason,
        "send_s": record.send_time - start,
        "ttft_s": record.ttft if ok else None,
        "tpot_s": record.tpot if ok else None,
        "e2e_s": record.e2e if ok else None,
        "generated_text": record.generated_text,
        "error": record.error,
    }


def run_to_json(run: RunResult, timeline_bin_s: float) -> dict:
    return {
        "request_rate": "inf" if math.isinf(run.request_rate) else run.request_rate,
        "max_concurrency": run.max_concurrency,
        "summary": summarize(run.records, run.duration_s),
        "timeline": throughput_timeline(run.records, run.start_time, timeline_bin_s),
        "requests": [request_row(r, run.start_time) for r in run.records],
    }


def _latency_values(run: RunResult, key: str) -> np.ndarray:
    done = [r for r in run.records if r.ok]
    if key == "itl":
        values = [gap for r in done for gap in r.itls]
    elif key == "tpot":
        values = [r.tpot for r in done if r.tpot is not None]
    else:
        values = [getattr(r, key) for r in done]
    return np.sort(np.asarray(values, dtype=np.float64)) * 1000.0


def _save(fig, axes, path: Path) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latency_cdfs(runs: list[RunResult], path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, LATENCIES):
        for run in runs:
            values = _latency_values(run, key)
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=rate_label(run))
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples")
    _save(fig, axes.flat, path)


def plot_throughput(runs_json: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run in runs_json:
        timeline = run["timeline"]
        label = f"rate={run['request_rate']}"
        ax.step(timeline["time_s"], timeline["output_tokens_per_s"], where="post", label=label)
    ax.set(title="Output throughput over time", xlabel="seconds since run start", ylabel="tokens/s")
    _save(fig, [ax], path)


def plot_vs_rate(runs_json: list[dict], path: Path) -> None:
    """TTFT and TPOT percentiles against the offered request rate (inf drawn at 1.5x the largest)."""
    finite = [r["request_rate"] for r in runs_json if r["request_rate"] != "inf"]
    inf_x = 1.5 * max(finite) if finite else 1.0
    xs = [inf_x if r["request_rate"] == "inf" else r["request_rate"] for r in runs_json]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key in zip(axes, ("ttft", "tpot")):
        for stat in ("median_ms", "p90_ms", "p99_ms"):
            ax.plot(xs, [r["summary"][key].get(stat, np.nan) for r in runs_json], "o-", label=stat)
        ax.set(title=f"{key.upper()} vs request rate", xlabel="requests/s", ylabel="ms")
    axes[2].plot(xs, [r["summary"]["output_throughput"] for r in runs_json], "o-")
    axes[2].set(title="Output throughput vs request rate", xlabel="requests/s", ylabel="tokens/s")
    for ax in axes:
        ax.set_xticks(xs, [str(r["request_rate"]) for r in runs_json])
    _save(fig, axes, path)


def _summary_table(runs_json: list[dict]) -> str:
    head = (
        "rate",
        "done",
        "req/s",
        "out tok/s",
        "TTFT med",
        "TTFT p99",
        "TPOT med",
        "TPOT p99",
        "ITL p99",
        "E2E med",
        "ended early",
    )
    rows = []
    for run in runs_json:
        s = run["summary"]
        cells = (
            run["request_rate"],
            f"{s['completed']}/{s['num_requests']}",
            f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}",
            *(
                f"{s[k].get(stat, float('nan')):.1f}"
                for k, stat in (
                    ("ttft", "median_ms"),
                    ("ttft", "p99_ms"),
                    ("tpot", "median_ms"),
                    ("tpot", "p99_ms"),
                    ("itl", "p99_ms"),
                    ("e2e", "median_ms"),
                )
            ),
            s["ended_early"],
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
    return f"<table border=1 cellpadding=4>{header}{''.join(rows)}</table>"


def _comparison_html(comparison: dict | None) -> str:
    if not comparison:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in comparison.items()
        if not isinstance(v, dict)
    )
    return f"<h2>Offline comparison</h2><table border=1 cellpadding=4>{rows}</table>"


def write_html(result: dict, images: list[str], path: Path) -> None:
    config = html.escape(json.dumps(result["config"], indent=2))
    figures = "".join(f'<p><img src="{name}" alt="{name}"></p>' for name in images)
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Serving benchmark</title></head><body>"
        f"<h1>Serving benchmark</h1><p>Latencies in ms. {html.escape(result['notes'])}</p>"
        f"{_summary_table(result['runs'])}{_comparison_html(result.get('comparison'))}{figures}"
        f"<h2>Configuration</h2><pre>{config}</pre></body></html>"
    )


def write_report(
    runs: list[RunResult],
    config: dict,
    notes: str,
    out_dir: Path,
    timeline_bin_s: float = 1.0,
    comparison: dict | None = None,
) -> dict:
    """Write result.json, the PNG plots and index.html into ``out_dir``; return the JSON dict."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"config": config, "notes": notes, "runs": [run_to_json(run, timeline_bin_s) for run in runs]}
    if comparison:
        result["comparison"] = comparison
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    images = []
    if plt is not None and runs:  # a transformers-only offline run has nothing to plot
        images = ["latency_cdf.png", "throughput_over_time.png"]
        plot_latency_cdfs(runs, out_dir / images[0])
        plot_throughput(result["runs"], out_dir / images[1])
        if len(runs) > 1:
            images.append("latency_vs_rate.png")
            plot_vs_rate(result["runs"], out_dir / images[2])
    elif plt is None:
        result["notes"] += " (matplotlib is not installed: no plots.)"
    write_html(result, images, out_dir / "index.html")
    return result
