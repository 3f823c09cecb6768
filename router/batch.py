"""StepPlan -> ForwardBatch: the flat token batch of one step, and where each chunk's logits land.

Logits rows come in chunk order: a chunk that wants prompt logprobs asks for every position that
scores a next prompt token, then a sampled chunk asks for its last position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.forward_batch import ForwardBatch, build_forward_batch
from router.step import StepPlan


@dataclass(slots=True)
class LogitsLayout:
    sample_rows: list[int]  # logits row of each sampled chunk, in chunk order
    sampled_chunks: list[int]  # index in plan.chunks of each sampled row
    prompt_rows: list[int]  # logits rows scoring prompt tokens
    prompt_next_ids: list[int]  # the prompt token each of those rows predicts
    prompt_chunks: list[tuple[int, int]]  # (chunk index, number of rows), in row order


def build_step_batch(plan: StepPlan, device: torch.device | str) -> tuple[ForwardBatch, LogitsLayout]:
    input_ids: list[int] = []
    out_slots: list[int] = []
    logits_indices: list[int] = []
    layout = LogitsLayout([], [], [], [], [])
    for index, chunk in enumerate(plan.chunks):
        request, offset = chunk.request, len(input_ids)
        input_ids += request.token_ids(chunk.start, chunk.end)
        out_slots += chunk.slots
        if chunk.num_prompt_logprob_rows is not None:
            num_rows = chunk.num_prompt_logprob_rows
            layout.prompt_rows += range(len(logits_indices), len(logits_indices) + num_rows)
            logits_indices += range(offset, offset + num_rows)
            layout.prompt_next_ids += request.params.prompt_ids[chunk.start + 1 : chunk.start + 1 + num_rows]
            layout.prompt_chunks.append((index, num_rows))
        if chunk.is_sampled:
            layout.sample_rows.append(len(logits_indices))
            layout.sampled_chunks.append(index)
            logits_indices.append(offset + chunk.num_tokens - 1)
    batch = build_forward_batch(
        input_ids=input_ids,
        req_rows=[chunk.request.row for chunk in plan.chunks],
        q_lens=[chunk.num_tokens for chunk in plan.chunks],
        kv_lens=[chunk.end for chunk in plan.chunks],
        out_slots=out_slots,
        logits_indices=logits_indices,
        device=device,
    )
    return batch, layout
