"""LightLLM's per-request features as TGI `parameters` extensions (API side).

    long_truncation_mode: "head" | "center" | "none"   (default: --long-truncation-mode, else none)
    token_healing: bool                                (default: --token-healing)
    return_all_prompt_logprobs: bool                   (default: --return-all-prompt-logprobs)

`prepare_features` runs inside validation, after TGI's `truncate` and before the length checks:
an over-long prompt is cut to the largest length that passes them (tgi_compat/api/lightllm/truncation.py), and
a healing request has its last tokens removed (tgi_compat/router/sampling/token_healing.py). `RequestFeatures` then
travels on the ValidatedRequest: it fills the engine request's extra fields, and `HealingOutput`
filters the generated tokens (tokens that only re-cover the removed prompt text are not emitted, and
the engine does not count them against max_new_tokens: tgi_compat/router/stopping.py; the
re-generated text is stripped from what is emitted).
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from tgi_compat.api.config import ServerConfig, ServingLimits
from tgi_compat.api.lightllm.truncation import kept_length, truncate_long_prompt
from tgi_compat.api.protocol.tgi import MAX_NEW_TOKENS_CHUNK, GenerateParameters
from tgi_compat.router.request import GenerateRequest as EngineRequest
from tgi_compat.router.sampling.token_healing import (
    HealingSplit,
    VocabularyTable,
    is_prefix_only,
    remaining_prefix,
    split_prompt,
)


class _Tokenizers(Protocol):
    @property
    def tokenizer(self) -> Any: ...  # the transformers tokenizer


class ServerView(Protocol):
    """What feature preparation reads of the server: its flags, its limits and its tokenizer (AppState is one)."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def limits(self) -> ServingLimits: ...
    @property
    def tokenizer(self) -> _Tokenizers: ...


_tables: weakref.WeakKeyDictionary[Any, VocabularyTable] = weakref.WeakKeyDictionary()


def healing_table(tokenizer: Any) -> VocabularyTable:
    """The vocabulary table of a transformers tokenizer, built once per tokenizer object."""
    table = _tables.get(tokenizer)
    if table is None:
        table = _tables[tokenizer] = VocabularyTable.from_tokenizer(tokenizer)
    return table


@dataclass(slots=True)
class RequestFeatures:
    truncation_mode: str | None  # "head" | "center" when the request may be truncated
    truncated_prompt_tokens: int = 0
    healing: HealingSplit | None = None
    healing_vocabulary: VocabularyTable | None = None
    all_prompt_logprobs: bool = False
    prompt_top_tokens: bool = False  # with top_n_tokens: details.prefill_top_tokens too

    @property
    def reports_truncation(self) -> bool:
        return self.truncation_mode is not None

    def apply_to(self, engine_request: EngineRequest) -> None:
        """Fill the engine request's LightLLM fields (called once per sequence)."""
        if self.all_prompt_logprobs:
            engine_request.prompt_logprobs = True
        if self.healing is not None:
            engine_request.prompt_ids = list(self.healing.prompt_ids)
            engine_request.healing_prefix = self.healing.prefix_text

    def output_filter(self) -> HealingOutput | None:
        if self.healing is None or self.healing_vocabulary is None:
            return None
        return HealingOutput(self.healing_vocabulary, self.healing.prefix_text)


def _request_or_server(value: Any, server_default: Any) -> Any:
    """A request parameter, or the server's default (a LightLLM flag) where the request left it unset."""
    return value if value is not None else server_default


async def prepare_features(
    state: ServerView, params: GenerateParameters, prompt_ids: list[int], *, constrained: bool = False
) -> tuple[list[int], RequestFeatures]:
    """Apply long truncation and token healing to a tokenized prompt (before the length checks).
    `constrained`: the request has a grammar, which constrains the text after the prompt, so a
    healed prompt tail could not be re-covered under it: such requests are not healed."""
    config, limits = state.config, state.limits
    mode = _request_or_server(params.long_truncation_mode, config.long_truncation_mode)
    features = RequestFeatures(
        truncation_mode=mode if mode in ("head", "center") else None,
        all_prompt_logprobs=bool(
            _request_or_server(params.return_all_prompt_logprobs, config.return_all_prompt_logprobs)
        ),
        prompt_top_tokens=bool(params.top_n_tokens),
    )
    if features.truncation_mode is not None:
        requested = params.max_new_tokens if params.max_new_tokens is not None else 0
        budget = kept_length(limits.max_input_tokens, limits.max_total_tokens, min(requested, MAX_NEW_TOKENS_CHUNK))
        truncated = truncate_long_prompt(prompt_ids, features.truncation_mode, budget)
        prompt_ids, features.truncated_prompt_tokens = truncated.prompt_ids, truncated.num_dropped
    if not constrained and _request_or_server(params.token_healing, config.token_healing):
        tokenizer = state.tokenizer.tokenizer
        table = _tables.get(tokenizer)
        if table is None:
            table = await asyncio.to_thread(healing_table, tokenizer)
        features.healing = split_prompt(prompt_ids, table)
        features.healing_vocabulary = table
    return prompt_ids, features


class HealingOutput:
    """One healing sequence's generated tokens, as the client must see them.

    `push` says whether a token counts (it adds text past the prompt) and strips the part of its
    text the prompt already had. Counting uses the token's bytes, exactly like the engine's mask;
    stripping works on the detokenized text, which may lag (a half UTF-8 character) or arrive in
    several pieces.
    """

    def __init__(self, vocabulary: VocabularyTable, prefix_text: str) -> None:
        self._vocabulary = vocabulary
        self._prefix_text = prefix_text
        self._pending_bytes = prefix_text.encode("utf-8")
        self._pending_text = prefix_text

    def push(self, token_id: int, text: str) -> tuple[bool, str]:
        """(counts, text to emit) for one generated token and its detokenized text."""
        counts = True
        if self._pending_bytes:
            counts = not is_prefix_only(self._vocabulary, self._pending_bytes, token_id)
            self._pending_bytes = remaining_prefix(self._vocabulary, self._pending_bytes, [token_id])
        text = self._strip(text)
        return counts or bool(text), text

    def _strip(self, text: str) -> str:
        pending = self._pending_text
        if not pending or not text:
            return text
        if text.startswith(pending):
            self._pending_text = ""
            return text[len(pending) :]
        if pending.startswith(text):
            self._pending_text = pending[len(text) :]
            return ""
        self._pending_text = ""  # the decoder changed the text (clean-up rules): show it as it is
        return text

    def final_text(self, generated_text: str) -> str:
        """`generated_text` of the whole sequence without the re-generated prompt text."""
        return (
            generated_text[len(self._prefix_text) :] if generated_text.startswith(self._prefix_text) else generated_text
        )


def add_lightllm_details(
    details: Any, features: RequestFeatures | None, result: Any, *, streaming: bool = False
) -> None:
    """Fill the detail extensions of the features a request used (Details or StreamDetails)."""
    if features is None:
        return
    if features.reports_truncation:
        details.truncated_prompt_tokens = features.truncated_prompt_tokens
    if features.all_prompt_logprobs:
        if streaming:
            details.prefill = result.prefill
        if features.prompt_top_tokens:
            details.prefill_top_tokens = result.prefill_top_tokens
