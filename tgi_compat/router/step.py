"""The typed objects between the three calls of a step: schedule -> execute -> update.

    Scheduler.schedule() -> StepPlan -> EngineCore executes (runner + sampler) -> StepResult
    Scheduler.update(StepPlan, StepResult) -> list[TokenEvent]

Tests build StepResults by hand (vLLM's CPU scheduler tests), so nothing here touches tensors (EAGLE-3's
auxiliary hidden states only ride along to the speculator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from tgi_compat.router.outputs import TopToken
from tgi_compat.router.request import Request

if TYPE_CHECKING:
    import torch


class ScheduledChunk(msgspec.Struct, gc=False):
    """One request's share of a step: positions [start, start + num_tokens) of prompt + generated.

    A msgspec Struct rather than a dataclass: one is made per request per step, and its
    constructor runs in C (about a fifth of a dataclass's __init__)."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_tokens: int
    slots: list[int]  # KV slot of each new token
    is_sampled: bool  # the chunk reaches the end of the sequence, so the next token is drawn
    # Positions whose logits score the next prompt token; None when prompt logprobs are not wanted.
    num_prompt_logprob_rows: int | None = None
    # Speculative decoding: the draft tokens after the sequence's last token (the chunk's tail positions);
    # every position of the chunk is sampled (tgi_compat/router/speculative/speculator.py).
    drafts: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def prefill_tokens(self) -> int:
        """Tokens the chunk takes from the step's prefill budget (decodes take none)."""
        is_decode = self.num_tokens == 1 and self.start > 0 and self.is_sampled
        return 0 if is_decode else self.num_tokens


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)  # freed this step; each gets a final event
    preempted: list[Request] = field(default_factory=list)
    # Prefix-cache hits of requests admitted this step: (req_to_token row, slots of positions 0..),
    # written into the row before the forward (their K/V is cached, so they are not computed).
    cached_prefixes: list[tuple[int, list[int]]] = field(default_factory=list)
    # (slot, adapter id): LoRA adapters placed in a device slot for this step's new requests
    lora_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class SampledToken(msgspec.Struct, gc=False):
    """One sampled row on the host (a Struct for the same reason as ScheduledChunk)."""

    token_id: int
    logprob: float
    top_tokens: list[TopToken] = msgspec.field(default_factory=list)


@dataclass(slots=True)
class PromptScores:
    """Logprobs of prompt tokens start+1 .. scored by one chunk (raw model distribution)."""

    logprobs: list[float]
    top_tokens: list[list[TopToken]] = field(default_factory=list)  # per position, when top_n_tokens


@dataclass(slots=True)
class StepResult:
    """Host-side output of one executed StepPlan, aligned with plan.chunks."""

    tokens: list[SampledToken | None]  # None where the chunk was not sampled
    prompt_scores: list[PromptScores | None] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> message; those requests fail
    # Verify chunks: chunk index -> the tokens sampled at its draft positions (after `tokens`' own one)
    verified: dict[int, list[SampledToken]] = field(default_factory=dict)
    # EAGLE-3: the step's auxiliary hidden states [its tokens, 3 * H] on the device, rows in chunk order
    aux_hidden: torch.Tensor | None = None
    forward_s: float = 0.0  # model forward time (for stats)
    sample_s: float = 0.0  # sampling + device-to-host copy time (for stats)

    @classmethod
    def failed(cls, plan: StepPlan, message: str) -> StepResult:
        return cls(
            tokens=[None] * len(plan.chunks),
            errors={chunk.request.request_id: message for chunk in plan.chunks},
        )
