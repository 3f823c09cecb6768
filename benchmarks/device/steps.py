"""The step driver the device benchmarks and tests/gpu share: random models of real shapes, a ModelRunner
over them, and prefill / decode steps driven straight through it (no router, no scheduler).

Request i owns row i and the slots [i * max_len, (i + 1) * max_len); the runner gets one spare row and slot
beyond those for CUDA-graph padding. Decode steps are timed from a context of random K/V written into the
cache (no prefill), over consecutive steps recorded with CUDA events, greedy argmax included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

if TYPE_CHECKING:
    from tgi_compat.router.engine import EngineCore
    from tgi_compat.router.request import GenerateRequest, SamplingParams

Weights = dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def hf_model(config: dict, dtype: torch.dtype, device: str = "cuda", num_layers: int | None = None):
    """A transformers model of this config with random weights, built on the device, and its config dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.eval(), hf_config.to_dict()


def random_weights(config: dict, dtype: torch.dtype, device: str = "cuda") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, random tensor) for every tensor of the transformers model of `config`, made one at a time:
    a model too large for two copies on one GPU (Mixtral, Gemma-2-9B) never exists twice."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    for name, tensor in meta.state_dict().items():
        yield name, torch.empty(tensor.shape, dtype=dtype, device=device).normal_(0.0, 0.02)


def build_runner(
    hf_config: dict,
    weights: Weights,
    dtype: str,
    backend: str | None,
    num_rows: int,
    max_len: int,
    device: str = "cuda",
    graph_sizes: list[int] | None = None,  # the runner's own CUDA graphs; default off (capture_graphs below)
    **runner_fields,  # more RunnerConfig fields, e.g. quantize
) -> ModelRunner:
    cfg = RunnerConfig(
        device=device,
        dtype=dtype,
        attention_backend=backend,
        num_kv_slots=num_rows * max_len + 1,
        max_rows=num_rows + 1,
        max_seq_len=max_len,
        show_progress=False,
        cuda_graph_batch_sizes=graph_sizes or [],
        **runner_fields,
    )
    pairs = weights.items() if isinstance(weights, dict) else weights
    return ModelRunner(cfg, ModelConfig.from_hf_dict(hf_config), pairs)


def eager_step(runner: ModelRunner) -> Callable[[ForwardBatch], torch.Tensor]:
    return getattr(runner, "_forward_eager", runner.forward)


def capture_graphs(runner: ModelRunner, batch_sizes: list[int]) -> DecodeCudaGraphs:
    graphs = DecodeCudaGraphs(
        eager_step(runner),
        batch_sizes,
        pad_row=runner.max_rows - 1,
        pad_slot=runner.num_kv_slots - 1,
        max_seq_len=runner.max_seq_len,
        device=runner.device,
    )
    graphs.capture()
    return graphs


def prefill_batch(runner: ModelRunner, prompts: list[list[int]], max_len: int) -> ForwardBatch:
    """One EXTEND step over all prompts (request i's tokens from slot i * max_len), logits at each prompt's end."""
    q_lens = [len(p) for p in prompts]
    ends = torch.tensor(q_lens).cumsum(0)
    return build_forward_batch(
        input_ids=[t for p in prompts for t in p],
        req_rows=list(range(len(prompts))),
        q_lens=q_lens,
        kv_lens=q_lens,
        out_slots=[i * max_len + pos for i, p in enumerate(prompts) for pos in range(len(p))],
        logits_indices=(ends - 1).tolist(),
        device=runner.device,
    )


def prefill(runner: ModelRunner, prompts: list[list[int]], max_len: int) -> torch.Tensor:
    """One EXTEND step over all prompts; returns logits [B, vocab] of each prompt's last token."""
    return runner.forward(prefill_batch(runner, prompts, max_len))


def decode_batch(next_ids: torch.Tensor, kv_lens: torch.Tensor, max_len: int) -> ForwardBatch:
    """A DECODE batch built on the device: token kv_len - 1 of request i goes to slot i * max_len + kv_len - 1."""
    num_reqs = next_ids.shape[0]
    rows = torch.arange(num_reqs, device=next_ids.device)
    positions = kv_lens - 1
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=next_ids,
        positions=positions,
        out_slots=rows * max_len + positions,
        req_rows=rows,
        q_start=rows,
        q_lens=torch.ones_like(rows),
        kv_lens=kv_lens,
        logits_indices=rows,
        # exact, as the router's batches carry it: the torch backend leaves a lone request unmasked
        max_q_len=1,
        max_kv_len=int(kv_lens.max()),
    )


def greedy_generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    num_new: int,
    max_len: int,
    graphs: DecodeCudaGraphs | None = None,
    forced: list[list[int]] | None = None,  # teacher forcing: feed these ids instead of our argmax
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy ids [B, num_new] and every step's logits, through prefill + decode steps."""
    logits = prefill(runner, prompts, max_len)
    all_logits, ids = [logits.clone()], [logits.argmax(-1)]
    kv_lens = torch.tensor([len(p) for p in prompts], device=runner.device)
    forced_ids = torch.tensor(forced, device=runner.device) if forced is not None else None
    for step in range(num_new - 1):
        kv_lens = kv_lens + 1
        feed = forced_ids[:, step] if forced_ids is not None else ids[-1]
        batch = decode_batch(feed, kv_lens, max_len)
        logits = graphs.replay(batch) if graphs is not None else runner.forward(batch)
        all_logits.append(logits.clone())
        ids.append(logits.argmax(-1))
    return torch.stack(ids, 1).tolist(), all_logits


def fill_context(runner: ModelRunner, batch: int, max_len: int, context: int) -> None:
    """Rows 0..batch-1 hold `context` tokens each in slots i * max_len + pos, with random K/V."""
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    positions = torch.arange(context, device=runner.device, dtype=torch.int32)
    rows = torch.arange(batch, device=runner.device, dtype=torch.int32)[:, None]
    runner.req_to_token[:batch, :context] = rows * max_len + positions


def time_decode(step, batch: int, max_len: int, vocab: int, steps: int, context: int) -> float:
    """Milliseconds per decode step over `steps` greedy steps from a `context`-token context."""
    ids = torch.randint(0, vocab, (batch,), device="cuda")
    kv_lens = torch.full((batch,), context + 1, device="cuda")
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


def profile_step(
    step, batch: int, max_len: int, vocab: int, context: int, top: int = 14, keep: int | None = 25
) -> list[dict]:
    """GPU time per kernel name for one decode step (summed over 4 steps / 4), largest first: the top `top`
    printed, the first `keep` returned (None: every kernel)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (batch,), device="cuda")
    kv_lens = torch.full((batch,), context + 1, device="cuda")
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
    print(f"profile B={batch} step: {total / 1e3:.3f} ms of kernel time per step", flush=True)
    for r in rows[:top]:
        print(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.0f}  {r['kernel']}", flush=True)
    return rows[:keep]


def decode_weight_bytes(runner: ModelRunner) -> int:
    """Bytes of weights one decode step reads: every parameter but the embedding table (gathered), a tied LM
    head counted once (it is the embedding)."""
    model = runner.model
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def engine_tokens(engine: EngineCore, requests: Iterable[GenerateRequest]) -> dict[str, list[int]]:
    """Adds the requests to an in-process engine and steps it until every one has ended: their tokens by id (the
    correctness checks that run one set of requests under two engine settings compare these)."""
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
    return tokens


def check_requests(requests: Iterable[tuple[list[int], SamplingParams, int]]) -> list[GenerateRequest]:
    """The correctness checks' (prompt, sampling, max_new_tokens) as requests c0, c1, ... ended by length."""
    from tgi_compat.router.request import GenerateRequest

    return [
        GenerateRequest(f"c{i}", prompt, sampling, max_new_tokens=max_new, ignore_eos=True)
        for i, (prompt, sampling, max_new) in enumerate(requests)
    ]
