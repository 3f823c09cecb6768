"""--diverse_mode on the GPU: shared-prefix decode attention for n = 8 siblings of a 2,000-token prompt (issue 42).

    python3 -m benchmarks.device.diverse [--work-dir /tmp/diverse-bench] [--groups 1,4,8,16] [--new-tokens 256]
        [--engine-groups 8[,16]] [--skip-check] [--skip-engine] [--skip-sweep] [--both-forms]
    python3 -m benchmarks.device.diverse --device cpu   # the CPU smoke run (tiny shapes, kernels interpreted)

1. Kernel: Llama-3-8B attention (32 q heads, 8 KV heads, d = 128, bf16), groups of G = 8 rows sharing a
   2,000-token prefix, each row with its own 1..256-token suffix: today's flash-decoding (decode.py, the split
   count and key block the Triton backend picks) against the shared-prefix kernel (shared_prefix.py) over the
   same rows, CUDA-graph replay times (timing.graph_ms), and the two outputs' difference. At --engine-groups
   groups, a sweep of the prefix's split count and pipeline stages around the one the backend picks.
2. Engine: an engine process (the server's own client, as overlap.py / engine_load.py), a random Llama-3-8B
   (--load-format dummy: config.json and the tokenizer only), 8 groups of n = 8 siblings (64 rows; each group one
   random 2,000-token prompt, each sibling its own seed) generating --new-tokens tokens each, diverse mode off then
   on. Output tok/s over the whole run, and over the decode phase alone (from the last first-token to the end),
   and the engine's own count of how its diverse decode steps grouped their rows (EngineStats.diverse_*).
First a check: a small float32 Llama (CUDA graphs) through in-process engines, diverse mode off vs on, n = 8
siblings greedy and seeded: every token must match and the siblings must have been grouped.
The table compares the decode phase's ratio with the issue's bar (>= 1.5x); JSON goes to $OUT/diverse.json.
With TGI_PROFILE_DIR (and TGI_PROFILE_STEPS) each engine profiles its steps into <dir>/off-<groups> or diverse-<groups>.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.stats import EngineStats

PREFIX_LEN, GROUP_SIZE, BAR = 2000, 8, 1.5
# TGI_PROFILE_DIR (tgi_compat/modeling/step_profiler.py): each mode's engine profiles into a folder of its own
PROFILE_ROOT = os.environ.get("TGI_PROFILE_DIR")


def log(message: str) -> None:
    print(f"[diverse {time.strftime('%H:%M:%S')}] {message}", flush=True)


def kernel_rows(groups: int, prefix_len: int, heads: tuple[int, int, int], device: str, seed: int = 0):
    """`groups` groups of GROUP_SIZE rows: a shared prefix's slots, then each row's own 1..256 slots."""
    import torch

    from tgi_compat.modeling.forward_batch import PrefixGroups

    num_heads, num_kv_heads, head_dim = heads
    gen = random.Random(seed)
    batch = groups * GROUP_SIZE
    suffixes = [gen.randint(1, min(256, prefix_len)) for _ in range(batch)]
    num_slots = groups * prefix_len + sum(suffixes) + 1
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    req_to_token = torch.zeros(batch + 1, prefix_len + max(suffixes), dtype=torch.int32)
    used, table_groups = 0, []
    for g in range(groups):
        prefix = perm[used : used + prefix_len]
        used += prefix_len
        positions = list(range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE))
        for b in positions:
            req_to_token[b, :prefix_len] = prefix
            req_to_token[b, prefix_len : prefix_len + suffixes[b]] = perm[used : used + suffixes[b]]
            used += suffixes[b]
        table_groups.append((prefix_len, positions))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    kv_lens = torch.tensor([prefix_len + s for s in suffixes], device=device)
    rows = torch.arange(batch, device=device)
    table = torch.tensor(PrefixGroups.rows(table_groups, batch, GROUP_SIZE), dtype=torch.int64, device=device)
    return q, k_cache, v_cache, req_to_token.to(device), rows, kv_lens, table


def kernel_case(groups: int, prefix_len: int, heads: tuple[int, int, int], device: str, sweep: bool = False) -> dict:
    """Today's decode attention vs the shared-prefix kernel over one batch of sibling groups, at the split counts the
    Triton backend picks; `sweep`: the shared-prefix kernel's time at other prefix split counts too."""
    import torch

    from tgi_compat.kernels.attention.decode import choose_block_n, choose_num_splits, decode_attention
    from tgi_compat.kernels.attention.shared_prefix import choose_prefix_splits, shared_prefix_decode_attention
    from tgi_compat.modeling.attention.triton_backend import (
        MAX_DECODE_SPLITS,
        SHARED_PREFIX_BLOCK_N,
        SHARED_PREFIX_GROUP_SUFFIX,
        SHARED_PREFIX_STAGES,
    )

    q, k_cache, v_cache, r2t, rows, kv_lens, groups_table = kernel_rows(groups, prefix_len, heads, device)
    batch, num_kv_heads, head_dim = q.shape[0], heads[1], heads[2]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    splits = choose_num_splits(batch, num_kv_heads, sms, MAX_DECODE_SPLITS)
    shared_block_n = SHARED_PREFIX_BLOCK_N if device == "cuda" else 16
    room = MAX_DECODE_SPLITS - splits
    prefix_splits = choose_prefix_splits(batch, GROUP_SIZE, num_kv_heads, sms, r2t.shape[1], shared_block_n, room)
    block_n = choose_block_n(batch, num_kv_heads, sms) if device == "cuda" else 16
    scale = head_dim**-0.5
    today_out, shared_out = torch.empty_like(q), torch.empty_like(q)

    def today() -> None:
        decode_attention(q, k_cache, v_cache, r2t, rows, kv_lens, scale, splits, out=today_out, block_n=block_n)

    def shared(
        num_prefix_splits: int = prefix_splits,
        num_stages: int = SHARED_PREFIX_STAGES,
        prefix_block_n: int = shared_block_n,
        warps: int = 4,
        group_suffix: bool = SHARED_PREFIX_GROUP_SUFFIX,
    ) -> None:
        shared_prefix_decode_attention(
            q, k_cache, v_cache, r2t, rows, kv_lens, groups_table, scale, splits, num_prefix_splits, out=shared_out,
            block_n=shared_block_n, prefix_block_n=prefix_block_n, num_warps=warps, num_stages=num_stages,
            group_suffix=group_suffix,
        )  # fmt: skip

    def rel_diff() -> float:
        return ((today_out.float() - shared_out.float()).norm() / today_out.float().norm()).item()

    today()
    # the kernel's other form (the group programs reading their members' own keys, or not), then the backend's
    other = not SHARED_PREFIX_GROUP_SUFFIX
    shared(group_suffix=other)
    other_diff = rel_diff()
    shared()
    result = dict(
        groups=groups, rows=batch, splits=splits, prefix_splits=prefix_splits, rel_diff=rel_diff(),
        group_suffix=SHARED_PREFIX_GROUP_SUFFIX, other_form_rel_diff=other_diff, stages=SHARED_PREFIX_STAGES,
    )  # fmt: skip
    if device == "cuda":
        from benchmarks.device.timing import graph_ms

        result["today_us"] = 1e3 * graph_ms(today)
        result["shared_us"] = 1e3 * graph_ms(shared)
        result["other_form_us"] = 1e3 * graph_ms(lambda: shared(group_suffix=other))
        result["speedup"] = result["today_us"] / result["shared_us"]
        # what the shared-prefix kernel must read: each group's prefix once, each row's own keys (K and V)
        keys = groups * prefix_len + int((kv_lens - prefix_len).sum())
        result["shared_tb_s"] = keys * num_kv_heads * head_dim * 2 * k_cache.element_size() / result["shared_us"] / 1e6
        if sweep:  # 4: last session's count at 8 groups
            counts = sorted({1, 2, 3, 4, 6, 8, 9, prefix_splits, 12, 16, 24, 32} & set(range(1, room + 1)))
            result["sweep_us"] = {
                f"{n}/stages{stages}{'/group-suffix' if fused else ''}": 1e3
                * graph_ms(lambda n=n, stages=stages, fused=fused: shared(n, stages, group_suffix=fused))
                for n in counts
                for stages in (2, 3)
                for fused in (False, True)
            }
            # wider prefix key blocks and more warps: more bytes in flight per program
            shapes = ((128, 4, 2), (128, 8, 2), (64, 8, 3), (128, 8, 3), (64, 8, 4))
            for n in sorted({prefix_splits, 4, 8} & set(range(1, room + 1))):
                for (block, warps, stages), fused in itertools.product(shapes, (False, True)):
                    name = f"{n}/stages{stages}/block{block}/warps{warps}{'/group-suffix' if fused else ''}"
                    try:
                        result["sweep_us"][name] = 1e3 * graph_ms(
                            lambda n=n, s=stages, b=block, w=warps, f=fused: shared(n, s, b, w, f)
                        )
                    except Exception as error:  # (shared memory past the SM's: reported, not fatal)
                        log(f"{name}: {type(error).__name__}: {str(error)[:200]}")
    log(json.dumps(result))
    return result


async def engine_case(
    model_dir: Path,
    diverse: bool,
    groups: int,
    new_tokens: int,
    prefix_len: int,
    device: str,
    group_suffix: bool | None = None,
):
    """Output tok/s of `groups` x GROUP_SIZE siblings through an engine process, diverse mode off or on; `group_suffix`
    True / False: the engine's shared-prefix kernel in that form (TGI_COMPAT_GROUP_SUFFIX), None: the backend's."""
    from benchmarks.device.engine_load import random_prompts, request, stream
    from tgi_compat.router.client import ZmqEngineClient
    from tgi_compat.router.request import SamplingParams

    rows = groups * GROUP_SIZE
    config = EngineConfig(
        model_id=str(model_dir),
        device=device,
        diverse_mode=diverse,
        max_running_requests=rows,  # CUDA graphs are captured up to this batch size
        max_total_tokens=prefix_len + new_tokens + 64,
        max_batch_prefill_tokens=8192,
    )
    config.load_format = "dummy"
    if device == "cpu":
        config.attention_backend = "triton"  # interpreted: the smoke run takes the GPU's path
        config.max_batch_total_tokens = 8 * (prefix_len + new_tokens) * groups
    if PROFILE_ROOT:  # (the engine process reads it when it starts)
        os.environ["TGI_PROFILE_DIR"] = os.path.join(PROFILE_ROOT, f"{'diverse' if diverse else 'off'}-{groups}")
    if group_suffix is not None:  # (read by the engine process's backend when it is imported)
        os.environ["TGI_COMPAT_GROUP_SUFFIX"] = "1" if group_suffix else "0"
    start = time.perf_counter()
    client = await ZmqEngineClient.start(config)
    load_s = time.perf_counter() - start
    rng = random.Random(0)

    async def run(tokens: int) -> tuple[float, list]:
        prompts = random_prompts(rng, groups, prefix_len)
        sampling = [SamplingParams(do_sample=True, seed=i, temperature=1.0) for i in range(GROUP_SIZE)]
        began = time.perf_counter()
        streams = await asyncio.gather(
            *(stream(client, request(p, tokens, sampling=s)) for p in prompts for s in sampling)
        )  # fmt: skip
        return began, streams

    try:
        await run(min(4, new_tokens))  # warm-up: compiles, prefix cache paths, graph replays
        before = await settled_stats(client)
        began, streams = await run(new_tokens)
        after = await settled_stats(client)
    finally:
        await client.shutdown()
    tokens = sum(s.tokens for s in streams)
    end = max(s.arrivals[-1] for s in streams)
    decode_start = max(s.arrivals[0] for s in streams)  # every row has its first token: all decode from here
    decode_tokens = sum(sum(1 for t in s.event_times() if t > decode_start) for s in streams)
    result = dict(
        diverse=diverse, rows=rows, load_s=load_s, tokens=tokens, tok_s=tokens / (end - began),
        decode_tok_s=decode_tokens / max(end - decode_start, 1e-9), grouping=grouping(before, after),
        group_suffix=group_suffix,
    )  # fmt: skip
    log(json.dumps(result))
    return result


async def settled_stats(client, timeout_s: float = 10.0) -> EngineStats:
    """The engine's report once it has gone idle: the first one from now on with no steps and nothing running
    or waiting (it sends one then, after the report of its last steps: cumulative counts up to date)."""
    previous, deadline = client.latest_stats, time.perf_counter() + timeout_s
    while (stats := client.latest_stats) is previous or stats.steps or stats.running or stats.queue_size:
        assert time.perf_counter() < deadline, f"no idle report from the engine within {timeout_s:g} s"
        await asyncio.sleep(0.05)
    return stats


def grouping(before: EngineStats, after: EngineStats) -> dict:
    """The timed run's --diverse_mode decode steps: how many, and how their rows grouped (mean per step)."""
    steps = after.diverse_steps - before.diverse_steps
    per_step = max(steps, 1)
    return dict(
        steps=steps,
        rows_per_step=(after.diverse_rows - before.diverse_rows) / per_step,
        grouped_rows_per_step=(after.diverse_grouped_rows - before.diverse_grouped_rows) / per_step,
        groups_per_step=(after.diverse_groups - before.diverse_groups) / per_step,
    )


def check_same_tokens(device: str, num_prompts: int = 3, new_tokens: int = 40) -> dict:
    """Diverse mode off vs on over a small float32 Llama (Triton backend; CUDA graphs on the GPU), in-process
    engines: `num_prompts` prompts x n = GROUP_SIZE siblings (half greedy, half seeded sampling) and a few loners.
    Every token must match, and the decode steps must have grouped the siblings."""
    import torch

    from benchmarks.device.steps import build_runner, check_requests, engine_tokens, hf_model
    from benchmarks.shapes import decoder
    from tgi_compat.router.engine import EngineCore
    from tgi_compat.router.request import SamplingParams

    small = decoder("LlamaForCausalLM", 256, 512, 2, 4, 2, 2000, max_position_embeddings=1024, rope_theta=10000.0)
    torch.manual_seed(0)
    model, hf_config = hf_model(small, torch.float32, device)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(60, 300))] for _ in range(num_prompts)]
    requests = [
        (prompt, SamplingParams(do_sample=p % 2 == 1, seed=k, temperature=0.9), new_tokens)
        for p, prompt in enumerate(prompts)
        for k in range(GROUP_SIZE)
    ] + [([rng.randrange(3, 2000) for _ in range(30)], SamplingParams(), new_tokens // 2) for _ in range(3)]
    outputs, largest = {}, 0
    for diverse in (False, True):
        graphs = [1, 2, 4, 8, 16, 32] if device == "cuda" else []
        runner = build_runner(
            hf_config, model.state_dict(), "float32", "triton", 32, 512, device, graphs, diverse_mode=diverse
        )
        engine = EngineCore(
            EngineConfig(model_id="random", max_running_requests=32, diverse_mode=diverse), runner, runner.model_config
        )
        outputs[diverse] = engine_tokens(engine, check_requests(requests))
        largest = max(largest, engine.executor.batch_builder.group_counts.largest)
    same = sum(outputs[False][k] == outputs[True].get(k) for k in outputs[False])
    result = dict(requests=len(requests), identical=same, largest_group=largest)
    log(json.dumps(dict(check=result)))
    return result


def table(kernels: list[dict], engines: list[dict]) -> str:
    lines = ["| case | today | diverse | ratio | bar | pass |", "|---|---|---|---|---|---|"]
    for k in kernels:
        if "speedup" in k:
            row = f"| attention, {k['groups']} groups x {GROUP_SIZE} rows, prefix {PREFIX_LEN} (us; "
            row += f"shared-prefix reads at {k['shared_tb_s']:.2f} TB/s) "
            row += f"| {k['today_us']:.1f} | {k['shared_us']:.1f} | {k['speedup']:.2f}x | - | - |"
            lines.append(row)
            form = "suffix programs" if k["group_suffix"] else "group programs reading their members' own keys"
            row = f"| attention, {k['groups']} groups, the other form ({form}) (us) "
            row += f"| {k['today_us']:.1f} | {k['other_form_us']:.1f} | {k['today_us'] / k['other_form_us']:.2f}x | - | - |"
            lines.append(row)
        chosen_config = f"{k['prefix_splits']}/stages{k['stages']}" + ("/group-suffix" if k["group_suffix"] else "")
        for config, us in k.get("sweep_us", {}).items():  # prefix splits / pipeline stages / form
            chosen = " (chosen)" if config == chosen_config else ""
            row = f"| attention, {k['groups']} groups, prefix splits/stages {config}{chosen} (us) "
            lines.append(row + f"| {k['today_us']:.1f} | {us:.1f} | {k['today_us'] / us:.2f}x | - | - |")
    off = {e["rows"]: e for e in engines if not e["diverse"]}
    for on in (e for e in engines if e["diverse"]):
        base = off[on["rows"]]
        # the issue's bar is on decoding; the whole run also holds the prompts' prefill (the same either way)
        for key, name, barred in (("decode_tok_s", "decode phase", True), ("tok_s", "whole run", False)):
            ratio = on[key] / base[key]
            verdict = ("yes" if ratio >= BAR else "no") if barred else "-"
            form = {None: "", False: ", suffix programs", True: ", group suffixes"}[on.get("group_suffix")]
            lines.append(
                f"| engine, {on['rows']} rows ({on['rows'] // GROUP_SIZE} x n={GROUP_SIZE}{form}), {name} (tok/s) "
                f"| {base[key]:.0f} | {on[key]:.0f} | {ratio:.2f}x | {f'>= {BAR}x' if barred else '-'} | {verdict} |"
            )
    for on in (e for e in engines if e["diverse"]):  # siblings really decoded as groups
        g = on["grouping"]
        lines.append(
            f"| engine, {on['rows']} rows, per diverse decode step ({g['steps']} steps): rows / grouped rows / "
            f"groups | - | {g['rows_per_step']:.1f} / {g['grouped_rows_per_step']:.1f} / {g['groups_per_step']:.2f} "
            "| - | - | - |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/diverse-bench"))
    parser.add_argument("--groups", default="1,4,8,16", help="kernel cases: groups of 8 rows")
    parser.add_argument("--engine-groups", default="8", help="engine cases: groups of n = 8 siblings, e.g. 8,16")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-check", action="store_true", help="skip the tokens-match check")
    parser.add_argument("--skip-sweep", action="store_true", help="no kernel sweep at the --engine-groups counts")
    parser.add_argument(
        "--both-forms",
        action="store_true",
        help="diverse mode on twice: the shared-prefix kernel's suffix programs, then its group programs reading "
        "their members' own keys (TGI_COMPAT_GROUP_SUFFIX=0 / 1)",
    )
    args = parser.parse_args()
    smoke = args.device == "cpu"
    if smoke:  # before any tgi_compat.kernels import: Triton reads it when a kernel is decorated
        os.environ["TRITON_INTERPRET"] = "1"
    from benchmarks.shapes import LLAMA3_8B, LLAMA3_TINY

    prefix_len = 40 if smoke else PREFIX_LEN
    heads = (4, 2, 16) if smoke else (32, 8, 128)
    check = {} if args.skip_check else check_same_tokens(args.device, *((1, 3) if smoke else ()))
    engine_groups = [int(g) for g in args.engine_groups.split(",")]
    kernels = [
        kernel_case(int(g), prefix_len, heads, args.device, sweep=int(g) in engine_groups and not args.skip_sweep)
        for g in args.groups.split(",")
    ]
    engines: list[dict] = []
    if not args.skip_engine:
        from benchmarks.device.tp import write_config_folder

        model = dict(LLAMA3_TINY if smoke else LLAMA3_8B)
        model_dir = args.work_dir / ("llama3-tiny-dummy" if smoke else "llama3-8b-dummy")
        write_config_folder(model_dir, model)
        forms: tuple[bool | None, ...] = (False, True) if args.both_forms else (None,)
        for groups in engine_groups:
            for diverse, form in [(False, None), *((True, form) for form in forms)]:
                case = engine_case(model_dir, diverse, groups, args.new_tokens, prefix_len, args.device, form)
                engines.append(asyncio.run(case))
    report = table(kernels, engines)
    if check:  # --skip-check: the GPU test runs the same check
        same = f"{check['identical']}/{check['requests']} requests' tokens identical, largest group {check['largest_group']}"
        print(f"check (diverse off vs on, small float32 Llama): {same}", flush=True)
    print(report, flush=True)
    out = os.path.join(os.environ.get("OUT") or args.work_dir, "diverse.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(dict(check=check, kernels=kernels, engines=engines, table=report), indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
