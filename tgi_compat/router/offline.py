"""Offline batch generation for tests and scripts (the shape of vLLM's `LLM.generate`).

    llm = LLM(EngineConfig(model_id=...))
    results = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(), max_new_tokens=16)
    results[0].token_ids, results[0].logprobs, results[0].finish_reason

It drives EngineCore.step() in the calling thread; no process, no event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.outputs import TokenEvent, TopToken
from tgi_compat.router.request import GenerateRequest, SamplingParams


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_tokens: list[list[TopToken]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    error: str | None = None
    seed: int | None = None

    def add(self, event: TokenEvent) -> None:
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.top_tokens += event.top_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason = event.finish_reason or self.finish_reason
        self.error = event.error or self.error
        self.seed = event.seed if event.seed is not None else self.seed


class LLM:
    def __init__(self, config: EngineConfig | None = None, *, engine: EngineCore | None = None) -> None:
        if engine is None:
            if config is None:
                raise ValueError("LLM needs an EngineConfig or an EngineCore")
            engine = EngineCore.from_config(config)
        self.engine = engine
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        max_new_tokens: int = 16,
        **request_fields,
    ) -> list[GenerationResult]:
        """Run every prompt to completion (continuous batching); results in prompt order."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        results: dict[str, GenerationResult] = {}
        for prompt, params in zip(prompts, sampling, strict=True):
            request_id = f"offline-{next(self._ids)}"
            request = GenerateRequest(
                request_id, list(prompt), _copy(params), max_new_tokens=max_new_tokens, **request_fields
            )
            self.engine.add_request(request)
            results[request_id] = GenerationResult(request_id, list(prompt))
        while self.engine.has_unfinished():
            for event in self.engine.step():
                if event.request_id in results:
                    results[event.request_id].add(event)
        return list(results.values())


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{name: getattr(params, name) for name in SamplingParams.__slots__})
