"""Baseline: ``transformers`` static batching over the same workload.

Prompts are taken in workload order, ``batch_size`` at a time, left-padded, and generated greedily with
``max_new_tokens`` = the largest reference length in the batch: the whole batch runs until its longest
member is done, which is the waste continuous batching removes. Only useful tokens are counted: per
request, up to its own reference length and up to its first EOS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.workload import Sample


@dataclass
class StaticBatchResult:
    num_requests: int
    batch_size: int
    duration_s: float
    useful_output_tokens: int  # tokens a request asked for and got, EOS-truncated
    generated_slots: int  # batch rows x decode steps actually run (includes padding waste)
    total_input_tokens: int

    def as_dict(self) -> dict:
        return {
            **self.__dict__,
            "output_throughput": self.useful_output_tokens / self.duration_s,
            "request_throughput": self.num_requests / self.duration_s,
            "slot_efficiency": self.useful_output_tokens / max(1, self.generated_slots),
        }


def load_hf_model(model_id: str, dtype: str, device: str):
    """Model + tokenizer from a local folder or a .gguf file (dequantized by transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.tokenizer import load_tokenizer

    path = Path(model_id)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    source = path.parent if path.suffix == ".gguf" else model_id
    tokenizer = load_tokenizer(model_id)  # the server's tokenizer (GGUF conversions cached)
    # torch_dtype: understood by transformers 4.x and (deprecated but honoured) 5.x alike.
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=getattr(torch, dtype), **kwargs)
    return model.to(device).eval(), tokenizer


def _useful_tokens(new_ids, limits: list[int], eos_ids: set[int]) -> int:
    """Per row: tokens before (and including) the first EOS, capped at the row's reference length."""
    total = 0
    for row, limit in zip(new_ids.tolist(), limits):
        row = row[:limit]
        ends = [i for i, tok in enumerate(row) if tok in eos_ids]
        total += ends[0] + 1 if ends else len(row)
    return total


def run_static_batching(
    model, tokenizer, samples: list[Sample], batch_size: int, show_progress: bool = True
) -> StaticBatchResult:
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
    device = next(model.parameters()).device
    useful = slots = 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for first in tqdm(
        range(0, len(samples), batch_size), desc="transformers static", disable=not show_progress, unit="batch"
    ):
        batch = samples[first : first + batch_size]
        inputs = tokenizer([s.prompt for s in batch], return_tensors="pt", padding=True).to(device)
        max_new = max(s.output_len for s in batch)
        with torch.inference_mode():
            out = model.generate(
                **inputs, max_new_tokens=max_new, min_new_tokens=1, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        new_ids = out[:, inputs["input_ids"].shape[1] :]  # [batch, steps]
        useful += _useful_tokens(new_ids, [s.output_len for s in batch], eos_ids)
        slots += new_ids.numel()
    sync()
    return StaticBatchResult(
        len(samples), batch_size, time.perf_counter() - start, useful, slots, sum(s.prompt_len for s in samples)
    )
