"""Execute a StepPlan: build the flat batch, run the model, sample, copy the results to the host.

A step is launched, then completed: `launch` queues the forward, the sampler and the one
device-to-host copy (on a GPU all asynchronous, so the host is free meanwhile) and `result` waits
for the copy and turns it into a StepResult. The engine's overlap scheduling schedules and launches
step N+1 between the two calls of step N.

A step with grammar-constrained rows is launched in two phases under overlap scheduling
(`launch(..., defer_sampling=True)` queues the forward only; `sample` queues the rest): its masks
depend on the tokens of the step before it, which the matchers accept only once that step's
result is on the host, so the engine completes step N-1 and fills step N's masks while step N's
forward runs on the device, then queues the sampling (vLLM v1's async scheduling with structured
output works the same way).

Failures are contained in `execute` (the plain, synchronous path): if a batch raises, its chunks
are retried one by one so that only the request that really fails is failed, and the engine keeps
serving the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from tgi_compat.modeling.parallel.vocab_logits import GreedyChoice
from tgi_compat.modeling.step_profiler import region
from tgi_compat.router.batch import LogitsLayout, StepBatchBuilder
from tgi_compat.router.cross_attention import CrossAttentionStore
from tgi_compat.router.image_cache import EncoderCache
from tgi_compat.router.request import Request
from tgi_compat.router.runner_api import Runner
from tgi_compat.router.sampling.output import SampledRows
from tgi_compat.router.sampling.selector import SelectionConfig, TokenSelector
from tgi_compat.router.step import PromptScores, SampledToken, StepPlan, StepResult

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _PromptRows:
    """A step's prompt-logprob rows on their way to the host."""

    rows: SampledRows
    chunks: list[tuple[int, int]]  # (chunk index, number of rows), in row order


@dataclass(slots=True)
class _DeferredSampling:
    """A launched step's logits rows to sample, and the requests they belong to."""

    logits: torch.Tensor  # [R, vocab] in the model's dtype, on the device
    requests: list[Request]
    offsets: list[int] | None  # LogitsLayout.sample_offsets


@dataclass(slots=True)
class LaunchedStep:
    """A step whose GPU work is queued; `result()` waits for it."""

    plan: StepPlan
    started: float  # perf_counter() when the launch began
    forward_s: float  # host time to build the batch and queue the forward
    sampled: SampledRows | None
    sampled_chunks: list[int]  # index in plan.chunks of each sampled row
    prompt: _PromptRows | None
    deferred: _DeferredSampling | None = None  # sampling not queued yet (StepExecutor.sample)
    verifies: bool = False  # some chunk verifies drafts: it has a sampled row per position
    aux_hidden: torch.Tensor | None = None  # EAGLE-3: the step's auxiliary hidden states, a copy

    @property
    def sampled_ids(self) -> torch.Tensor | None:
        """[R] on the device: the inputs of the next step's pending tokens."""
        assert self.deferred is None, "a deferred step is sampled before the next one is launched"
        return self.sampled.output.token_ids if self.sampled is not None else None

    def result(self) -> StepResult:
        assert self.deferred is None, "StepExecutor.sample() queues a deferred step's sampling first"
        waited = time.perf_counter()
        plan = self.plan
        result = StepResult(tokens=[None] * len(plan.chunks), prompt_scores=[None] * len(plan.chunks))
        result.aux_hidden = self.aux_hidden
        if self.sampled is not None:
            tokens = self.sampled.rows()
            if len(tokens) == len(plan.chunks) and not self.verifies:  # every chunk sampled once
                result.tokens = cast(list[SampledToken | None], tokens)  # the same list; every row is a token
            else:
                for chunk_index, token in zip(self.sampled_chunks, tokens):
                    if result.tokens[chunk_index] is None:
                        result.tokens[chunk_index] = token
                    else:  # a verify chunk's next positions
                        result.verified.setdefault(chunk_index, []).append(token)
        if self.prompt is not None:
            scored, offset = self.prompt.rows.rows(), 0
            for chunk_index, num_rows in self.prompt.chunks:
                rows = scored[offset : offset + num_rows]
                offset += num_rows
                result.prompt_scores[chunk_index] = PromptScores(
                    logprobs=[r.logprob for r in rows],
                    top_tokens=[list(r.top_tokens) for r in rows],
                )
        result.forward_s, result.sample_s = self.forward_s, time.perf_counter() - waited
        return result


class StepExecutor:
    def __init__(
        self,
        runner: Runner,
        selection: SelectionConfig,
        lora_enabled: bool = False,
        images: EncoderCache | None = None,
        prefix_group_max: int = 0,
        aux_rows: Callable[[int], torch.Tensor] | None = None,  # EAGLE-3: a step's auxiliary hidden states
        cross: CrossAttentionStore | None = None,  # a cross-attending model's image keys (then `images` is None)
    ) -> None:
        self.runner = runner
        self.aux_rows = aux_rows
        self.device = selection.device
        self.selector = TokenSelector(selection)
        self.batch_builder = StepBatchBuilder(self.device, lora_enabled, images, prefix_group_max, cross)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step to its result, failures contained."""
        if plan.is_empty:
            return StepResult(tokens=[])
        try:
            return self.launch(plan).result()
        except Exception as exc:  # noqa: BLE001 - any failure of a step must stay contained
            if len(plan.chunks) == 1:
                request_id = plan.chunks[0].request.request_id
                logger.exception("step failed for request %s", request_id)
                return StepResult.failed(plan, f"{type(exc).__name__}: {exc}")
            logger.warning("batch of %d failed (%s); isolating the culprit", len(plan.chunks), exc)
            return self._run_one_by_one(plan)

    def _run_one_by_one(self, plan: StepPlan) -> StepResult:
        merged = StepResult(tokens=[], prompt_scores=[])
        for chunk in plan.chunks:  # (rewriting every hit's row each time is harmless: same slots)
            single = self.execute(StepPlan(chunks=[chunk], cached_prefixes=plan.cached_prefixes))
            if single.verified:
                merged.verified[len(merged.tokens)] = single.verified[0]
            merged.tokens += single.tokens
            merged.prompt_scores += single.prompt_scores or [None]
            merged.errors.update(single.errors)
            merged.forward_s += single.forward_s
            merged.sample_s += single.sample_s
        return merged

    @torch.inference_mode()
    def launch(
        self,
        plan: StepPlan,
        previous: LaunchedStep | None = None,
        *,
        defer_sampling: bool = False,
        after_images: Callable[[], None] | None = None,
    ) -> LaunchedStep:
        """Queue a non-empty step's work. `previous`: the step in flight whose sampled ids are the
        inputs of this plan's pending tokens (overlap scheduling). `defer_sampling`: queue the
        forward (and prompt scoring) only; `sample()` queues the sampling later. `after_images`: called
        when building the step's inputs queued an encoder call, before its forward is queued (a step whose image
        rows all come from the encoder cache has nothing queued ahead of its forward, and overlaps as text does)."""
        started = time.perf_counter()
        previous_ids = previous.sampled_ids if previous is not None else None
        input_rows = _input_rows(plan, previous) if previous is not None and previous_ids is not None else None
        with region("step.build"):
            batch, layout = self.batch_builder.build(plan, previous_ids, input_rows)
        if after_images is not None and batch.images is not None and batch.images.encoded:
            after_images()
        requests = [plan.chunks[i].request for i in layout.sampled_chunks]
        every_row_sampled = len(requests) == batch.logits_indices.shape[0] and not layout.prompt_chunks
        batch.greedy_only = bool(requests) and every_row_sampled and self.selector.greedy_only(requests)
        with region("step.forward"):
            logits = self.runner.forward(batch)  # [R, vocab], or a greedy_only batch's GreedyChoice
        # (copied on the device: the next forward, which may be launched before this step's update, rewrites them)
        aux_hidden = None if self.aux_rows is None else self.aux_rows(batch.num_tokens).clone()
        forward_s = time.perf_counter() - started
        sampled = prompt = deferred = None
        if isinstance(logits, GreedyChoice):  # a sharded model's choice: its logits were never gathered
            sampled = self.selector.from_greedy_choice(logits)
        else:
            if layout.sample_rows:
                rows = self._rows(logits, layout.sample_rows)
                if defer_sampling:
                    deferred = _DeferredSampling(rows, requests, layout.sample_offsets)
                else:
                    with region("step.sample"):
                        sampled = self.selector.sample(rows, requests, layout.sample_offsets)
            if layout.prompt_chunks:
                prompt = _PromptRows(self._score_prompts(plan, layout, logits), layout.prompt_chunks)
        verifies = layout.sample_offsets is not None
        return LaunchedStep(
            plan, started, forward_s, sampled, layout.sampled_chunks, prompt, deferred, verifies, aux_hidden
        )

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep) -> None:
        """Queue the sampling of a step launched with `defer_sampling`: its grammar masks are filled
        now, from the tokens the matchers have accepted so far, while its forward runs."""
        deferred, launched.deferred = launched.deferred, None
        if deferred is not None:
            with region("step.sample"):
                launched.sampled = self.selector.sample(deferred.logits, deferred.requests, deferred.offsets)

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits[rows]; no copy in the usual all-decode step, where rows are all of them."""
        if len(rows) == logits.shape[0] and rows[-1] == len(rows) - 1:  # rows ascend, so this is 0..R-1
            return logits
        return logits[torch.tensor(rows, dtype=torch.int64, device=self.device)]

    def _score_prompts(self, plan: StepPlan, layout: LogitsLayout, logits: torch.Tensor) -> SampledRows:
        top_n = [plan.chunks[i].request.params.sampling.top_n_tokens for i, n in layout.prompt_chunks for _ in range(n)]
        return self.selector.score_prompt(self._rows(logits, layout.prompt_rows), layout.prompt_next_ids, top_n)


def _input_rows(plan: StepPlan, previous: LaunchedStep) -> list[int | None]:
    """Which row of `previous`'s sampled ids feeds each chunk of `plan`: a request with a pending
    token decodes it next, and that token is the row its chunk of `previous` sampled."""
    chunks = previous.plan.chunks
    row_of = {id(chunks[chunk_index].request): row for row, chunk_index in enumerate(previous.sampled_chunks)}
    return [row_of[id(c.request)] if c.request.num_pending_tokens else None for c in plan.chunks]
