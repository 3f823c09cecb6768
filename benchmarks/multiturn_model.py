"""What prefix caching can give a multi-turn replay (benchmarks/multiturn.py), from a step-level model.

    python -m benchmarks.multiturn_model --tokenizer /tmp/llama3 --num-conversations 256 --min-turns 4 \
        --concurrency 128 --max-output-len 128 [--history model] [--hold-steps 0 8]

The replay's turns (the same ShareGPT conversations, lengths from the tokenizer) run through a model of
the engine: every step decodes one token for each running turn and prefills waiting turns up to a
budget; a decode-only step costs `decode_base_ms + decode_row_us` per row (a CUDA graph), a step with
any prefill adds `eager_ms` (it runs eager) and `prefill_us_per_token` per token (Llama-3-8B: 2 x 8e9
FLOP a token at ~600 TFLOP/s = 27 us). Waiting turns join as TGI's batching admits them
(waiting_served_ratio 0.3, max_waiting_tokens 20 steps); with the cache, a turn whose prefill after
its cached prefix is <= 512 tokens joins after `hold` decode steps (tgi_compat/router/scheduler.py). With the
cache a follow-up turn prefills only its new tokens (own history: the user turn; reference history:
the previous reference answer too). Each conversation sends its next turn `client_ms` after its answer.
Prints output tok/s and TTFT p50 with the cache off and on, and their ratio.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.multiturn import multiturn_workload
from benchmarks.tokenizer import load_tokenizer


@dataclass(frozen=True)
class TurnCost:
    prompt: int  # tokens of the whole prompt (history + this turn)
    new: int  # of those, not served by the previous turn's cached prompt (and answer)
    output: int


@dataclass(frozen=True)
class Engine:
    decode_base_ms: float = 6.5
    decode_row_us: float = 16.0  # 64 rows: 7.5 ms a decode step
    eager_ms: float = 10.0  # a mixed step without CUDA graph (H200, 64 rows: 17 ms eager vs 6.2 replayed)
    prefill_us_per_token: float = 2 * 8e9 / 600e12 * 1e6
    prefill_budget: int = 4096
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    short_prefill_tokens: int = 512
    client_ms: float = 30.0


def turn_costs(
    tokenizer, conversations, own_history: bool, answer_ids_cached: int | None = None
) -> list[list[TurnCost]]:
    """Per conversation, per turn: prompt, uncached and output tokens as the replay sends them.
    `answer_ids_cached`: of an own answer, the leading tokens whose text re-tokenizes to the ids it
    was generated as (the cache serves those only; None: all). A random-weight Llama-3's answers do
    for ~24 of 128 tokens (uniform random ids through the Llama-3 tokenizer: mean 24, median 18)."""
    out = []
    for conversation in conversations:
        turns: list[TurnCost] = []
        for index, turn in enumerate(conversation):
            if index == 0:
                turns.append(TurnCost(turn.request.prompt_len, turn.request.prompt_len, turn.request.max_new_tokens))
                continue
            question = len(tokenizer(turn.question, add_special_tokens=False).input_ids) + 2  # + "\n\n"
            previous = turns[-1]
            if own_history:  # history = the previous prompt and its (capped) answer, cached as far as it round-trips
                uncached = 0 if answer_ids_cached is None else max(0, previous.output - answer_ids_cached)
                prompt, new = previous.prompt + previous.output + question, question + uncached
            else:  # the reference answer was never generated: it is new too
                prompt = turn.request.prompt_len
                new = prompt - previous.prompt
            turns.append(TurnCost(prompt, new, turn.request.max_new_tokens))
        out.append(turns)
    return out


@dataclass(eq=False)
class _Client:
    """One conversation slot of the replay: its remaining turns and the turn in progress."""

    turns: list[TurnCost]
    ready_at: float = 0.0  # when its next turn is sent
    to_prefill: int = 0
    to_decode: int = 0
    sent_at: float = 0.0
    waiting: TurnCost | None = None  # sent, not admitted yet


def simulate(
    conversations: list[list[TurnCost]], concurrency: int, cache: bool, hold: int, engine: Engine
) -> tuple[float, float, float]:
    """(output tok/s, TTFT p50 s, duration s) of the closed-loop replay."""
    queue = [list(c) for c in reversed(conversations)]
    clients = [_Client(queue.pop()) for _ in range(min(concurrency, len(queue)))]
    now, out, since_admission, ttfts = 0.0, 0, 0, []
    waiting: list[_Client] = []
    while any(c.turns or c.to_decode for c in clients) or waiting:
        for c in clients:
            if not c.to_decode and c.waiting is None and c.turns and c.ready_at <= now:
                c.waiting, c.sent_at = c.turns.pop(0), now
                waiting.append(c)
        decoding = [c for c in clients if c.to_decode and not c.to_prefill]
        prefilling = [c for c in clients if c.to_prefill]
        if waiting and _admits(waiting[0], len(waiting), len(decoding), since_admission, cache, hold, engine):
            for c in waiting:
                assert c.waiting is not None
                c.to_prefill = c.waiting.new if cache else c.waiting.prompt
                c.to_decode, c.waiting = c.waiting.output, None
            prefilling += waiting
            waiting, since_admission = [], 0
        if not decoding and not prefilling:
            now = min(c.ready_at for c in clients if c.turns)
            continue
        budget, prefilled, first_tokens = engine.prefill_budget, 0, []
        for c in prefilling:
            take = min(c.to_prefill, budget)
            budget, prefilled, c.to_prefill = budget - take, prefilled + take, c.to_prefill - take
            if not c.to_prefill:
                first_tokens.append(c)
        now += 1e-3 * (engine.decode_base_ms + 1e-3 * engine.decode_row_us * (len(decoding) + len(first_tokens)))
        if prefilled:
            now += 1e-3 * engine.eager_ms + 1e-6 * engine.prefill_us_per_token * prefilled
        else:
            since_admission += 1
        ttfts += [now - c.sent_at for c in first_tokens]
        for c in decoding + first_tokens:
            c.to_decode -= 1
            out += 1
            if not c.to_decode:
                c.ready_at = now + 1e-3 * engine.client_ms
                if not c.turns and queue:
                    c.turns = queue.pop()
    ttfts.sort()
    return out / now, ttfts[len(ttfts) // 2], now


def _admits(
    first: _Client, num_waiting: int, num_decoding: int, since_admission: int, cache: bool, hold: int, engine: Engine
) -> bool:
    """TGI's batching (tgi_compat/router/scheduler.py's _admission_is_due), with the cache's shorter hold."""
    assert first.waiting is not None
    short = cache and first.waiting.new <= engine.short_prefill_tokens
    return (
        not num_decoding
        or num_waiting >= int(num_decoding * engine.waiting_served_ratio)
        or since_admission >= engine.max_waiting_tokens
        or (short and since_admission >= hold)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multiturn_model", description=__doc__)
    parser.add_argument("--tokenizer", default=None, help="default: benchmarks.tokenizer's")
    parser.add_argument("--num-conversations", type=int, default=256)
    parser.add_argument("--min-turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--history", choices=("model", "reference"), default="model")
    parser.add_argument("--hold-steps", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--eager-ms", type=float, default=Engine.eager_ms)
    parser.add_argument(
        "--answer-ids-cached", type=int, default=None, help="of an own answer, tokens that re-tokenize (default all)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    workload = multiturn_workload(
        tokenizer, args.num_conversations, args.max_context, args.max_output_len, args.seed, args.min_turns
    )
    conversations = turn_costs(tokenizer, workload, args.history == "model", args.answer_ids_cached)
    turns = [t for c in conversations for t in c]
    print(
        f"{len(conversations)} conversations, {len(turns)} turns: mean prompt {sum(t.prompt for t in turns) / len(turns):.0f}"
        f" tokens, {sum(t.new for t in turns) / len(turns):.0f} uncached, {sum(t.output for t in turns) / len(turns):.0f} out"
    )
    engine = Engine(eager_ms=args.eager_ms)
    off, off_ttft, off_s = simulate(conversations, args.concurrency, False, 0, engine)
    print(f"cache off: {off:.0f} out tok/s, TTFT p50 {1e3 * off_ttft:.0f} ms, {off_s:.0f} s")
    for hold in args.hold_steps:
        on, on_ttft, on_s = simulate(conversations, args.concurrency, True, hold, engine)
        print(
            f"cache on, short prefills held {hold} steps: {on:.0f} out tok/s ({on / off:.2f}x), "
            f"TTFT p50 {1e3 * on_ttft:.0f} ms ({on_ttft / off_ttft:.2f}x), {on_s:.0f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
