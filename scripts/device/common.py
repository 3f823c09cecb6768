"""Helpers shared by the GPU scripts (not CI): random models of real shapes, a tiny step driver.

The driver gives request i row i and the slot range [i * max_len, (i + 1) * max_len), then runs
prefill and decode steps through ModelRunner.forward (or a DecodeCudaGraphs replay), with no router.
"""

from __future__ import annotations

import torch

from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
QWEN2_7B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)


def hf_model(config: dict, dtype: torch.dtype, device: str = "cuda", num_layers: int | None = None):
    """A transformers model of this config with random weights, built directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.eval(), hf_config.to_dict()


def build_runner(
    hf_config: dict,
    state_dict: dict,
    dtype: str,
    backend: str,
    num_rows: int,
    max_len: int,
    device: str = "cuda",
    graph_sizes: list[int] | None = None,  # the runner's own CUDA graphs (--cuda-graphs); default off here
) -> ModelRunner:
    """One spare row and slot beyond the driver's (num_rows, num_rows * max_len) for graph padding."""
    cfg = RunnerConfig(
        device=device,
        dtype=dtype,
        attention_backend=backend,
        num_kv_slots=num_rows * max_len + 1,
        max_rows=num_rows + 1,
        max_seq_len=max_len,
        show_progress=False,
        cuda_graph_batch_sizes=graph_sizes or [],
    )
    return ModelRunner.from_hf_state_dict(hf_config, state_dict, cfg)


def eager_step(runner: ModelRunner):
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


def prefill(runner: ModelRunner, prompts: list[list[int]], max_len: int) -> torch.Tensor:
    """One EXTEND step over all prompts; returns logits [B, vocab] of each prompt's last token."""
    q_lens = [len(p) for p in prompts]
    ends = torch.tensor(q_lens).cumsum(0)
    batch = build_forward_batch(
        input_ids=[t for p in prompts for t in p],
        req_rows=list(range(len(prompts))),
        q_lens=q_lens,
        kv_lens=q_lens,
        out_slots=[i * max_len + pos for i, p in enumerate(prompts) for pos in range(len(p))],
        logits_indices=(ends - 1).tolist(),
        device=runner.device,
    )
    return runner.forward(batch)


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
