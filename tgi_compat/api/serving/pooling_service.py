"""The pooling routes' service: each prompt of a request goes to the engine as its own prefill-only request
(tgi_compat/router/pooling_engine.py batches them with everyone else's) and comes back as one vector: an
embedding, a classifier's scores or a reward."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from tgi_compat.api.protocol.answers import JsonAnswer
from tgi_compat.api.protocol.errors import TgiError, incomplete_generation_error, validation_error
from tgi_compat.api.protocol.pooling import (
    ROUTES_OF_TASK,
    ClassificationRequest,
    EmbeddingRequest,
    PoolingBody,
    PoolingRequest,
    ScoreRequest,
    check_dimensions,
    classification_data,
    embedding_data,
    list_response,
)
from tgi_compat.api.serving.one_step import final_event
from tgi_compat.api.serving.state import Service
from tgi_compat.api.serving.validation import check_token_ids, truncate_prompt
from tgi_compat.router.request import FinishReason
from tgi_compat.router.request import GenerateRequest as EngineRequest


def _refuse_generation(body: PoolingBody | ScoreRequest) -> None:
    if fields := body.generation_fields():
        raise validation_error(f"`{fields[0]}` is a generation parameter; a pooling model takes none")


class PoolingService(Service):
    async def embeddings(self, body: EmbeddingRequest) -> JsonAnswer:
        def data(outputs: list[list[float]]) -> list[dict[str, Any]]:
            check_dimensions(body.dimensions, len(outputs[0]))
            return embedding_data(outputs, body.encoding_format, "embedding")

        return await self._answer(body, "/v1/embeddings", "embedding generation", "embd", data)

    async def pooling(self, body: PoolingRequest) -> JsonAnswer:
        def data(outputs: list[list[float]]) -> list[dict[str, Any]]:
            return embedding_data(outputs, body.encoding_format, "pooling")

        return await self._answer(body, "/pooling", "pooling", "pool", data)

    async def classify(self, body: ClassificationRequest) -> JsonAnswer:
        def data(outputs: list[list[float]]) -> list[dict[str, Any]]:
            return classification_data(outputs, self.state.engine.info.labels)

        return await self._answer(body, "/classify", "classification", "classify", data)

    async def score(self, body: ScoreRequest) -> JsonAnswer:
        """LightLLM's `/get_score`: the reward of the whole conversation."""
        try:
            self._check_route("/get_score")
            _refuse_generation(body)
            if len(labels := self.state.engine.info.labels) > 1:
                raise validation_error(
                    f"a reward is one score; this classifier has {len(labels)} labels: use /classify"
                )
            ids = await self._prompt_ids(body.chat, None, "score")
            output = await self._pool_one(ids)
        except TgiError as error:
            return JsonAnswer.error(error)
        return JsonAnswer({"score": output[0], "prompt_tokens": len(ids), "finish_reason": FinishReason.LENGTH.value})

    async def _answer(
        self,
        body: PoolingBody,
        route: str,
        operation: str,  # what vLLM's over-long error says the input was for
        id_prefix: str,
        data: Callable[[list[list[float]]], list[dict[str, Any]]],
    ) -> JsonAnswer:
        """Every prompt of the body pooled, in vLLM's list response (`data` builds its items)."""
        try:
            self._check_route(route)
            outputs, num_tokens = await self._pool_batch(body, operation)
            items = data(outputs)
        except TgiError as error:
            return JsonAnswer.error(error)
        return JsonAnswer(list_response(id_prefix, self.state.served_model_name, items, num_tokens))

    def _check_route(self, route: str) -> None:
        task = self.state.engine.info.pooling_task
        if task is None:
            raise validation_error(
                f"{route} serves pooling models (embedding, classification, reward); this one generates"
            )
        if route not in ROUTES_OF_TASK[task]:
            raise validation_error(
                f"this {task} model does not serve {route}; it serves {', '.join(ROUTES_OF_TASK[task])}"
            )

    async def _pool_batch(self, body: PoolingBody, operation: str) -> tuple[list[list[float]], int]:
        """Every prompt of the body pooled: (outputs in input order, prompt tokens in all)."""
        _refuse_generation(body)
        prompts = body.prompts()
        if not prompts:
            raise validation_error("`input` cannot be empty")
        # the permits first, as TGI takes them before it validates: a body of more prompts than could ever run at
        # once is refused before any of them is tokenized
        with self.state.permits.hold(len(prompts)):
            batch = [
                await self._prompt_ids(p, body.truncate_prompt_tokens, operation, body.add_special_tokens)
                for p in prompts
            ]
            outputs = await asyncio.gather(*(self._pool_one(ids) for ids in batch))
        return outputs, sum(map(len, batch))

    async def _prompt_ids(
        self, prompt: str | list[int], truncate: int | None, operation: str, add_special_tokens: bool = True
    ) -> list[int]:
        limit = self.state.limits.max_input_tokens
        if isinstance(prompt, str):
            try:
                ids = await self.state.tokenizer.encode(prompt, add_special_tokens)
            except Exception as error:  # any tokenizer failure is the client's input
                raise validation_error(f"tokenizer error {error}") from error
        else:
            ids = check_token_ids(prompt, self.state.engine.info.vocab_size) if prompt else []
        if truncate is not None:
            if truncate == -1:
                truncate = limit
            if not 0 < truncate <= limit:
                raise validation_error(f"`truncate_prompt_tokens` must be -1 or in 1..{limit}. Given: {truncate}")
            ids = truncate_prompt(ids, truncate)
        if not ids:
            raise validation_error("`input` cannot be empty")
        if len(ids) > limit:  # vLLM's text
            raise validation_error(
                f"This model's maximum context length is {limit} tokens. However, you requested {len(ids)} tokens "
                f"in the input for {operation}. Please reduce the length of the input."
            )
        return ids

    async def _pool_one(self, ids: list[int]) -> list[float]:
        request = EngineRequest(request_id=uuid.uuid4().hex, prompt_ids=ids, max_new_tokens=1)
        event = await final_event(self.state.engine, request)
        if event.pooled is None:
            raise incomplete_generation_error(False)
        return event.pooled
