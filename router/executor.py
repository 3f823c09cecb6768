"""Execute a StepPlan: build the flat batch, run the model, sample, copy the results to the host.

Failures are contained here: if a batch raises, its chunks are retried one by one so that only the
request that really fails is failed, and the engine keeps serving the rest.

A caller may pass `while_gpu_works`: it runs once per executed step, after the forward and the
sampler are launched and before the host blocks on their results (on a GPU both run
asynchronously, so the host is free meanwhile; the engine process sends and receives messages then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from modeling.forward_batch import ForwardBatch
from router.batch import LogitsLayout, StepBatchBuilder
from router.request import Request
from router.sampling import Sampler, SamplingBatch, score_prompt
from router.sampling_cache import SamplingBatchCache
from router.step import PromptScores, StepPlan, StepResult

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine needs of modeling.runner.ModelRunner (tests pass hand-made runners)."""

    num_kv_slots: int

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # logits [R, vocab] float32
        ...


class StepExecutor:
    def __init__(self, runner: Runner, vocab_size: int, device: torch.device | str) -> None:
        self.runner = runner
        self.device = torch.device(device)
        self.sampler = Sampler(vocab_size, self.device)
        self.batch_builder = StepBatchBuilder(self.device)
        self.sampling_cache = SamplingBatchCache(vocab_size, self.device)
        self.healer = None  # router.token_healing.TokenHealer, set on the first healing request
        self._while_gpu_works: Callable[[], None] | None = None  # this step's hook, until it has run
        self._hook_error: Exception | None = None

    def execute(self, plan: StepPlan, while_gpu_works: Callable[[], None] | None = None) -> StepResult:
        """Run one step. `while_gpu_works` is called exactly once when the plan is not empty: while
        the GPU runs the step, or after a failure that came before that point. An exception it raises
        neither fails the step nor is lost: `raise_hook_error()` re-raises it once the caller has
        applied the step's result."""
        if plan.is_empty:
            return StepResult(tokens=[])
        self._while_gpu_works = while_gpu_works
        try:
            return self._execute(plan)
        finally:
            self._run_hook()

    def raise_hook_error(self) -> None:
        error, self._hook_error = self._hook_error, None
        if error is not None:
            raise error

    def _run_hook(self) -> None:
        hook, self._while_gpu_works = self._while_gpu_works, None
        if hook is None:
            return
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - kept for raise_hook_error(): the step must finish first
            self._hook_error = exc

    def _execute(self, plan: StepPlan) -> StepResult:
        try:
            return self._run(plan)
        except Exception as exc:  # noqa: BLE001 - any failure of a step must stay contained
            if len(plan.chunks) == 1:
                request_id = plan.chunks[0].request.request_id
                logger.exception("step failed for request %s", request_id)
                return StepResult.failed(plan, f"{type(exc).__name__}: {exc}")
            logger.warning("batch of %d failed (%s); isolating the culprit", len(plan.chunks), exc)
            return self._run_one_by_one(plan)

    def _run_one_by_one(self, plan: StepPlan) -> StepResult:
        merged = StepResult(tokens=[], prompt_scores=[])
        for chunk in plan.chunks:
            single = self._execute(StepPlan(chunks=[chunk]))
            merged.tokens += single.tokens
            merged.prompt_scores += single.prompt_scores or [None]
            merged.errors.update(single.errors)
            merged.forward_s += single.forward_s
            merged.sample_s += single.sample_s
        return merged

    @torch.inference_mode()
    def _run(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        batch, layout = self.batch_builder.build(plan)
        logits = self.runner.forward(batch)  # [R, vocab]
        forward_done = time.perf_counter()
        result = StepResult(tokens=[None] * len(plan.chunks), prompt_scores=[None] * len(plan.chunks))
        if layout.sample_rows:
            sampling = self._sampling_batch([plan.chunks[i].request for i in layout.sampled_chunks])
            output = self.sampler(self._rows(logits, layout.sample_rows), sampling)
            self.sampling_cache.sampled(output.token_ids)
            self._run_hook()  # the forward and the sampler are queued on the device; to_host waits
            sampled = output.to_host()
            if len(sampled) == len(plan.chunks):  # every chunk sampled (sampled_chunks is 0..n-1)
                result.tokens = sampled
            else:
                for chunk_index, token in zip(layout.sampled_chunks, sampled):
                    result.tokens[chunk_index] = token
        if layout.prompt_chunks:
            self._run_hook()  # a no-op when it ran above; else the forward is still in flight
            self._score_prompts(plan, layout, logits, result)
        result.forward_s, result.sample_s = forward_done - started, time.perf_counter() - forward_done
        return result

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        return self.sampling_cache.get(requests, self.healer)

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits[rows] as float32; no copy in the usual all-decode step, where rows are all of them."""
        if len(rows) == logits.shape[0] and rows[-1] == len(rows) - 1:  # rows ascend, so this is 0..R-1
            return logits.float()
        return logits[torch.tensor(rows, dtype=torch.int64, device=self.device)].float()

    def _score_prompts(self, plan: StepPlan, layout: LogitsLayout, logits: torch.Tensor, result: StepResult) -> None:
        top_n = [plan.chunks[i].request.params.prompt_top_n for i, n in layout.prompt_chunks for _ in range(n)]
        scored = score_prompt(
            self._rows(logits, layout.prompt_rows),
            torch.tensor(layout.prompt_next_ids, dtype=torch.int64, device=self.device),
            torch.tensor(top_n, dtype=torch.int64, device=self.device),
        ).to_host()
        offset = 0
        for chunk_index, num_rows in layout.prompt_chunks:
            rows = scored[offset : offset + num_rows]
            offset += num_rows
            result.prompt_scores[chunk_index] = PromptScores(
                logprobs=[r.logprob for r in rows],
                top_tokens=[list(r.top_tokens) for r in rows],
            )

