"""The API process's tokenizer: encode prompts off the event loop, decode ids, byte offsets.

Tokenizing is CPU work; it runs on `--validation-workers` threads so one long prompt does not
stall every stream (TGI runs validation workers the same way).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tgi_compat.api.protocol.tgi import SimpleToken

logger = logging.getLogger(__name__)

_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_tokenizer_service(model_id: str, revision: str | None = None, workers: int = 2) -> TokenizerService:
    """The tokenizer plus its chat template, EOS set and limits (tgi_compat.modeling.tokenizer.TokenizerInfo)."""
    from tgi_compat.modeling.tokenizer import load_tokenizer_info

    info = load_tokenizer_info(model_id, revision)
    return TokenizerService(info.tokenizer, workers=workers, info=info)


def _raw_decoder(tokenizer: Any) -> Any | None:
    """The Rust `tokenizers.Tokenizer.decode` when transformers would add nothing to it.

    Streaming decodes twice per token; transformers' wrapper (argument normalisation, cleanup
    checks) costs several times the Rust call. It only changes the text when
    clean_up_tokenization_spaces is on, so that case keeps the wrapper.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


def _raw_encoder(tokenizer: Any) -> Any | None:
    """The Rust `tokenizers.Tokenizer.encode_batch_fast` when it gives transformers' ids.

    transformers' `__call__` runs the same Rust encode, plus the character offsets of every token,
    an attention mask and its own argument handling: ~20% more time on a 4,000-token prompt, and
    a long prompt is tokenized on every request. `encode_batch_fast` skips the offsets and, like
    every batch call, releases the GIL, so the validation workers encode in parallel. A backend
    configured to truncate, pad or split special tokens keeps the wrapper (which resets those)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens:
        return None
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    return backend.encode_batch_fast


@dataclass(frozen=True, slots=True)
class _QueuedPrompt:
    text: str
    add_special_tokens: bool
    future: asyncio.Future[list[int]]
    loop: asyncio.AbstractEventLoop

    def deliver(self, result: list[int] | Exception) -> None:
        """(worker thread) Hand the ids or the error to the waiting request on its event loop."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result)
        except RuntimeError:  # its loop closed meanwhile: nobody waits
            pass


def _settle(future: asyncio.Future[list[int]], result: list[int] | Exception) -> None:
    if future.done():  # its request went away meanwhile
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


@dataclass(frozen=True, slots=True)
class ByteSpan:
    id: int
    start: int  # byte offsets into the UTF-8 text
    stop: int


class TokenizerService:
    def __init__(self, tokenizer: Any, workers: int = 2, info: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.info = info  # tgi_compat.modeling.tokenizer.TokenizerInfo when loaded through load_tokenizer_service
        self.special_ids: frozenset[int] = frozenset(tokenizer.all_special_ids) | frozenset(
            token_id
            for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(added, "special", False)
        )
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._raw_decode = _raw_decoder(tokenizer)
        self._raw_encode = _raw_encoder(tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tokenize")
        self._queued: list[_QueuedPrompt] = []  # waiting for a free worker, which takes them all
        self._queue_lock = threading.Lock()

    # ---- encode (off the loop) ----
    def encode_sync(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._raw_encode is not None:
            return self._raw_encode([text], add_special_tokens=add_special_tokens)[0].ids
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode on a `--validation-workers` thread. With the Rust fast path, prompts that arrive
        while every worker is busy wait together and the next free worker encodes up to one per
        core in one `encode_batch_fast` call, which tokenizers spreads over the cores: 16 long
        prompts arriving at once no longer queue two at a time behind TGI's default of 2 workers."""
        loop = asyncio.get_running_loop()
        if self._raw_encode is None:
            return await loop.run_in_executor(self._executor, self.encode_sync, text, add_special_tokens)
        future: asyncio.Future[list[int]] = loop.create_future()
        with self._queue_lock:
            self._queued.append(_QueuedPrompt(text, add_special_tokens, future, loop))
        self._executor.submit(self._encode_queued)  # finds the queue empty if a busy worker took it
        return await future

    def _encode_queued(self) -> None:
        """(worker thread) Encode every queued prompt, one batch call per add_special_tokens value."""
        assert self._raw_encode is not None
        with self._queue_lock:  # at most one prompt per core: a bigger batch only delays the first ones
            queued, self._queued = self._queued[:_CORES], self._queued[_CORES:]
        for add_special_tokens in (True, False):
            batch = [prompt for prompt in queued if prompt.add_special_tokens == add_special_tokens]
            if not batch:
                continue
            try:
                encodings = self._raw_encode([p.text for p in batch], add_special_tokens=add_special_tokens)
                results: list[list[int] | Exception] = [encoding.ids for encoding in encodings]
            except Exception:  # one bad text fails the whole call: encode one by one so only it fails
                results = [self._encode_or_error(p.text, add_special_tokens) for p in batch]
            for prompt, result in zip(batch, results):
                prompt.deliver(result)

    def _encode_or_error(self, text: str, add_special_tokens: bool) -> list[int] | Exception:
        try:
            return self.encode_sync(text, add_special_tokens)
        except Exception as error:
            return error

    def spans_sync(self, text: str, add_special_tokens: bool = True) -> list[ByteSpan]:
        encoded = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        # Character offsets -> UTF-8 byte offsets (TGI reports bytes).
        byte_at = [0] * (len(text) + 1)
        for index, char in enumerate(text):
            byte_at[index + 1] = byte_at[index] + len(char.encode("utf-8"))
        return [
            ByteSpan(token_id, byte_at[start], byte_at[stop])
            for token_id, (start, stop) in zip(encoded["input_ids"], encoded["offset_mapping"])
        ]

    async def spans(self, text: str, add_special_tokens: bool = True) -> list[ByteSpan]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.spans_sync, text, add_special_tokens)

    # ---- decode (cheap; called on the loop) ----
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One id decoded alone, no cleanup (TGI's text for top tokens and prefill tokens)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._queue_lock:
            queued, self._queued = self._queued, []
        for prompt in queued:  # their workers' tasks were cancelled
            prompt.deliver(RuntimeError("the tokenizer is shutting down"))


def simple_tokens(text: str, spans: list[ByteSpan]) -> list[dict[str, Any]]:
    """SimpleToken dicts for tokenizer spans of `text`; offsets count UTF-8 bytes (TGI)."""
    raw = text.encode("utf-8")
    return [
        SimpleToken(
            id=span.id,
            text=raw[span.start : span.stop].decode("utf-8", errors="replace"),
            start=span.start,
            stop=span.stop,
        ).to_dict()
        for span in spans
    ]
