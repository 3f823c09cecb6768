"""Wire formats of the pooling routes: vLLM's `/v1/embeddings` (OpenAI's embeddings shape), `/pooling` and
`/classify`, and LightLLM's reward `/get_score`. TGI itself serves no embeddings.

Requests take one prompt or a batch: a string, strings, token ids, or lists of token ids. Unknown fields are
ignored, as vLLM does, except generation parameters, which a pooling model refuses by name.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tgi_compat.api.protocol.errors import validation_error

PromptInput = str | list[str] | list[int] | list[list[int]]

# task -> the routes that serve it (a classifier with one label scores like a reward model)
ROUTES_OF_TASK = {
    "embed": ("/v1/embeddings", "/pooling"),
    "classify": ("/classify", "/pooling", "/get_score"),
    "reward": ("/get_score", "/pooling"),
}
# body fields of the generation routes (TGI's, OpenAI's, vLLM's, LightLLM's) that mean nothing to a pooling model
GENERATION_FIELDS = frozenset(
    {
        "parameters",
        "sampling_params",
        "max_tokens",
        "max_new_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "best_of",
        "stream",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "do_sample",
        "use_beam_search",
    }
)


class _PoolingModelBody(BaseModel):
    """A body for a pooling model: unknown fields are ignored, but generation parameters named."""

    model_config = ConfigDict(extra="allow")

    def generation_fields(self) -> list[str]:
        return sorted(GENERATION_FIELDS & set(self.model_extra or {}))


class PoolingBody(_PoolingModelBody):
    """What every pooling request carries (vLLM's PoolingBasicRequestMixin and CompletionRequestMixin)."""

    model: str | None = None
    input: PromptInput
    # keep only the last k prompt tokens; -1: the longest input the server takes
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The batch, one prompt (text or token ids) each."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(v, int) for v in value):
            return [list(value)]  # type: ignore[arg-type]  # one prompt of token ids
        return list(value)  # type: ignore[arg-type]  # strings, or prompts of token ids


class EmbeddingRequest(PoolingBody):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own size (no Matryoshka truncation)


class PoolingRequest(PoolingBody):
    encoding_format: Literal["float", "base64"] = "float"


class ClassificationRequest(PoolingBody):
    pass


class ScoreRequest(_PoolingModelBody):
    """LightLLM's `/get_score` body: the whole conversation as one prompt."""

    chat: str


def check_dimensions(requested: int | None, size: int) -> None:
    if requested is not None and requested != size:
        raise validation_error(
            f"the model's embeddings have {size} dimensions and no Matryoshka representation: "
            f"`dimensions` {requested} cannot be served"
        )


def encode_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: little-endian float32 bytes (what the openai client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def usage(num_prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens, "completion_tokens": 0}


def list_response(prefix: str, model: str, data: list[dict[str, Any]], num_prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(num_prompt_tokens),
    }


def embedding_data(outputs: list[list[float]], encoding_format: str, kind: str) -> list[dict[str, Any]]:
    """`/v1/embeddings` (kind "embedding": the vector in `embedding`) or `/pooling` (kind "pooling": in `data`)."""
    field = "embedding" if kind == "embedding" else "data"
    return [
        {"index": i, "object": kind, field: encode_vector(output, encoding_format)} for i, output in enumerate(outputs)
    ]


def classification_data(outputs: list[list[float]], labels: tuple[str, ...]) -> list[dict[str, Any]]:
    """vLLM's `/classify`: the head's probabilities (softmax; a sigmoid for a one-label head) and the top label."""
    data = []
    for i, logits in enumerate(outputs):
        probs = [1 / (1 + math.exp(-logits[0]))] if len(logits) == 1 else _softmax(logits)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best] if labels else None, "probs": probs, "num_classes": len(probs)})
    return data


def _softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]
