"""Incremental detokenization and stop strings, exactly as TGI's shard does them (docs/contract.md §14-15).

Token text uses an offset window over prompt + generated ids: decode(ids[prefix:read]) is the
context already shown, decode(ids[prefix:]) the context plus new ids; the difference is the new
text. Up to 5 prompt tokens of context keep SentencePiece/BPE leading spaces right, and a
trailing U+FFFD (half of a multi-byte character) holds the text back until it completes.
"""

from __future__ import annotations

import re
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, prompt_ids: list[int]) -> None:
        self._decoder = decoder
        self._ids = list(prompt_ids)
        self._num_prompt = len(prompt_ids)
        # TGI slices with prompt_len - 5, which goes negative for short prompts; clamp at 0.
        self._prefix_offset = max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(prompt_ids)

    @property
    def generated_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    def push(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        prefix_text = self._decoder.decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decoder.decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def final_text(self) -> str:
        """generated_text: specials skipped, one prompt token of left context (TGI's decode_tokens)."""
        generated = self.generated_ids
        context = self._ids[self._num_prompt - 1 : self._num_prompt] if self._num_prompt else []
        prefix_text = self._decoder.decode(context, skip_special_tokens=True)
        full_text = self._decoder.decode(context + generated, skip_special_tokens=True)
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            return full_text[len(prefix_text) :]
        return ""


class StopStringMatcher:
    """TGI's StopSequenceCriteria: a rolling text buffer tested with `re.escape(stop) + "$"`.

    Like TGI, `$` also matches just before a final newline, and the buffer keeps only the last
    200 characters once it passes 300 (a stop string longer than that may be missed).
    """

    _KEEP = 200
    _TRIM_AT = 300

    def __init__(self, stop_sequences: list[str]) -> None:
        self._patterns = [re.compile(re.escape(stop) + "$") for stop in stop_sequences]
        self._buffer = ""

    def __bool__(self) -> bool:
        return bool(self._patterns)

    def push(self, text: str) -> bool:
        """Append a token's text; True when the output now ends with a stop sequence."""
        if not self._patterns:
            return False
        self._buffer += text
        if len(self._buffer) > self._TRIM_AT:
            self._buffer = self._buffer[-self._KEEP :]
        return any(pattern.search(self._buffer) for pattern in self._patterns)
