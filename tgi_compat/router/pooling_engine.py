"""PoolingEngineCore: the engine of a pooling model (an embedding, classification or reward checkpoint).

Every request is prefill-only: its whole prompt runs in one step and the runner returns its pooled output
(an embedding, or the head's scores) instead of logits to sample. A step packs the waiting requests, oldest
first, into one flat EXTEND batch of at most `max_batch_prefill_tokens` tokens (a longer prompt runs alone)
and `max_running_requests` rows. Nothing outlives a step, so a step's requests take rows 0..B-1 and KV slots
0..T-1 and give them back when it ends: no slot pool, no prefix cache (a cached prefix has no hidden states
to pool), no chunking (mean pooling needs every token's hidden state in the step).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Protocol

import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import ForwardBatch, build_forward_batch
from tgi_compat.router.client_api import Refusal, RequestRejectedError
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import engine_info
from tgi_compat.router.lora_calls import AdapterCalls
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import FinishReason, GenerateRequest
from tgi_compat.router.runner_api import Runner
from tgi_compat.router.stats import EngineStats
from tgi_compat.router.validation import validate_request

logger = logging.getLogger(__name__)


class PoolingRunner(Runner, Protocol):
    pooling_task: str | None  # "embed" | "classify" | "reward"
    max_rows: int

    def pool(self, batch: ForwardBatch) -> torch.Tensor:
        """[B, output] float32 for a step of whole prompts (tgi_compat.modeling.runner.ModelRunner.pool)."""
        ...


class PoolingEngineCore:
    def __init__(self, config: EngineConfig, runner: PoolingRunner, model_config: ModelConfig) -> None:
        assert runner.pooling_task is not None, "a pooling model's runner"
        self.runner = runner
        labels = _labels(model_config) if runner.pooling_task == "classify" else ()
        self.info = dataclasses.replace(
            engine_info(config, runner, model_config), pooling_task=runner.pooling_task, labels=labels
        )
        self.max_step_tokens = config.max_batch_prefill_tokens
        self.max_step_rows = min(config.max_running_requests, runner.max_rows)
        self.waiting: deque[GenerateRequest] = deque()
        self.adapter_calls = AdapterCalls(None)  # pooling models take no LoRA: every call is refused

    def add_request(self, params: GenerateRequest) -> None:
        validate_request(params, self.info)  # ids in the vocabulary, the prompt within max_total_tokens
        if len(params.prompt_ids) > self.runner.num_kv_slots:
            raise RequestRejectedError(Refusal.KV_CAPACITY, len(params.prompt_ids))
        self.waiting.append(params)

    def abort(self, request_id: str) -> None:
        # a step's requests are done by the time the loop reads messages again: only waiting ones remain
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def run_once(self) -> tuple[list[TokenEvent], EngineStats | None]:
        return (self.step() if self.waiting else []), None

    def close(self) -> None:
        self.runner.close()

    def step(self) -> list[TokenEvent]:
        """Pool the next batch of waiting requests: one event each, its output in `pooled`."""
        return self._pool_contained(self._next_batch())

    def _pool_contained(self, requests: list[GenerateRequest]) -> list[TokenEvent]:
        try:
            return self._pool(requests)
        except Exception as exc:  # a failing batch must not stop the engine: only the request that fails fails
            if len(requests) == 1:
                logger.exception("pooling failed for request %s", requests[0].request_id)
                return [_failed(requests[0], exc)]
            logger.warning("pooling batch of %d failed (%s); isolating the culprit", len(requests), exc)
            return [event for request in requests for event in self._pool_contained([request])]

    def _next_batch(self) -> list[GenerateRequest]:
        batch = [self.waiting.popleft()]
        num_tokens = len(batch[0].prompt_ids)
        while self.waiting and len(batch) < self.max_step_rows:
            size = len(self.waiting[0].prompt_ids)
            if num_tokens + size > min(self.max_step_tokens, self.runner.num_kv_slots):
                break
            batch.append(self.waiting.popleft())
            num_tokens += size
        return batch

    def _pool(self, requests: list[GenerateRequest]) -> list[TokenEvent]:
        lens = [len(r.prompt_ids) for r in requests]
        ids = [t for r in requests for t in r.prompt_ids]
        rows = list(range(len(requests)))
        batch = build_forward_batch(ids, rows, lens, lens, list(range(len(ids))), [], self.runner.device)
        pooled = self.runner.pool(batch).cpu().tolist()  # the one device-to-host copy
        return [
            TokenEvent(r.request_id, pooled=out, finish_reason=FinishReason.LENGTH, num_prompt_tokens=n)
            for r, out, n in zip(requests, pooled, lens)
        ]


def _labels(model_config: ModelConfig) -> tuple[str, ...]:
    """A classifier's label names in output order (transformers' id2label; LABEL_i where it has none)."""
    from tgi_compat.modeling.models.pooling import num_labels

    id2label = model_config.hf_config.get("id2label") or {}
    return tuple(id2label.get(str(i), f"LABEL_{i}") for i in range(num_labels(model_config.hf_config)))


def _failed(request: GenerateRequest, exc: Exception) -> TokenEvent:
    return TokenEvent(request.request_id, finish_reason=FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
