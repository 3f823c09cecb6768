"""Token healing (LightLLM's `--token_healing_mode`): regenerate the prompt's last tokens.

A prompt that ends mid-word ("https:", "The answer is (", "Hel") ends on a token the model would
rarely have produced there; generating after it gives odd continuations. Healing backs the
prompt up by its last tokens (LightLLM: two) and constrains the first generated tokens to
vocabulary entries consistent with the removed text P:

    allowed(P) = { t : bytes(t) starts with P }  (t covers P and goes on: healing ends)
               U { t : bytes(t) is a non-empty proper prefix of P }  (P shrinks, healing goes on)

All matching is on the *bytes* each token stands for (byte-level BPE's `Ġ`-alphabet and
SentencePiece's `▁`/`<0xNN>` pieces undone), so a token that carries half of a UTF-8
character still compares exactly. Special tokens are never allowed while healing (they stand
for no text), so a healing step cannot end the request.

Who does what:
  * API (tgi_compat): `split_prompt` removes the tokens and gives the removed text; the engine
    request carries it as `GenerateRequest.healing_prefix`; the API strips the re-generated text
    from what it emits.
  * engine: the tokens that only re-cover the prompt do not count against max_new_tokens
    (tgi_compat/router/stopping.py); `TokenHealer.blocked_rows` gives, for the rows being sampled, a [B, V] mask applied
    to the logits before every other processor. The still-uncovered part of P is recomputed from
    the request's output ids (`remaining_prefix`), so preemption and re-prefill need no state.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tgi_compat.router.request import Request

LIGHTLLM_HEALED_TOKENS = 2  # LightLLM backs up the last two prompt tokens
MASK_CACHE_SIZE = 512  # distinct remaining prefixes kept as device masks


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()


def byte_level_bytes(piece: str) -> bytes:
    """`Ġhello` -> b" hello"; characters outside the alphabet (added tokens) stay UTF-8."""
    if all(char in _BYTE_LEVEL for char in piece):
        return bytes(_BYTE_LEVEL[char] for char in piece)
    return piece.encode("utf-8")


def sentencepiece_bytes(piece: str) -> bytes:
    """`▁hello` -> b" hello"; byte-fallback pieces `<0x0A>` -> b"\\n"."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


class VocabularyTable:
    """The bytes every token id stands for, with a sorted index for prefix queries."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: Iterable[int] = ()) -> None:
        special = set(special_ids)
        # Special tokens and empty pieces stand for no text: never candidates while healing.
        self.token_bytes: list[bytes] = [b"" if i in special else b for i, b in enumerate(token_bytes)]
        self.size = len(self.token_bytes)
        order = sorted((b, i) for i, b in enumerate(self.token_bytes) if b)
        self._sorted_bytes = [b for b, _ in order]
        self._sorted_ids = [i for _, i in order]
        self._ids_by_bytes: dict[bytes, list[int]] = {}
        for piece, token_id in order:
            self._ids_by_bytes.setdefault(piece, []).append(token_id)

    @classmethod
    def from_pieces(
        cls, pieces: Sequence[str | None], byte_level: bool, special_ids: Iterable[int] = ()
    ) -> VocabularyTable:
        to_bytes = byte_level_bytes if byte_level else sentencepiece_bytes
        return cls([to_bytes(p) if p else b"" for p in pieces], special_ids)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> VocabularyTable:
        """From a transformers tokenizer: its vocabulary pieces, added tokens as their plain text."""
        size = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        byte_level = _is_byte_level(tokenizer, pieces)
        to_bytes = byte_level_bytes if byte_level else sentencepiece_bytes
        token_bytes = [to_bytes(p) if p else b"" for p in pieces]
        special = set(tokenizer.all_special_ids)
        for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if token_id < size:
                token_bytes[token_id] = added.content.encode("utf-8")
            if getattr(added, "special", False):
                special.add(token_id)
        return cls(token_bytes, special)

    def text_bytes(self, token_ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes[i] if 0 <= i < self.size else b"" for i in token_ids)

    def allowed_ids(self, prefix: bytes) -> list[int]:
        """Ids whose bytes start with `prefix`, plus ids whose bytes are a proper prefix of it."""
        allowed = []
        start = bisect.bisect_left(self._sorted_bytes, prefix)
        for index in range(start, len(self._sorted_bytes)):
            if not self._sorted_bytes[index].startswith(prefix):
                break
            allowed.append(self._sorted_ids[index])
        for cut in range(1, len(prefix)):
            allowed.extend(self._ids_by_bytes.get(prefix[:cut], ()))
        return allowed


def _is_byte_level(tokenizer: PreTrainedTokenizerBase, pieces: Sequence[str | None]) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is not None:  # its JSON names the pieces: ByteLevel, or Metaspace/Replace("▁")/ByteFallback
        text = json.dumps(json.loads(decoder.__getstate__()))
        if "ByteLevel" in text:
            return True
        if "\\u2581" in text or "Metaspace" in text or "ByteFallback" in text:
            return False
    # No decoder to read: count the markers in the vocabulary.
    sample = [p for p in pieces[:20000] if p]
    return sum(p.startswith("\u0120") for p in sample) >= sum(p.startswith("\u2581") for p in sample)


def remaining_prefix(table: VocabularyTable, prefix: bytes, output_ids: Sequence[int]) -> bytes:
    """The part of the removed text that the generated ids have not covered yet (b"" = healed)."""
    for token_id in output_ids:
        if not prefix:
            break
        piece = table.token_bytes[token_id] if 0 <= token_id < table.size else b""
        if piece and prefix.startswith(piece) and len(piece) < len(prefix):
            prefix = prefix[len(piece) :]
        else:  # covers the rest (or, unconstrained, ignores it): healing is over either way
            prefix = b""
    return prefix


def is_prefix_only(table: VocabularyTable, prefix: bytes, token_id: int) -> bool:
    """True when `token_id`, generated while `prefix` is pending, adds no text beyond the prompt."""
    piece = table.token_bytes[token_id] if 0 <= token_id < table.size else b""
    return bool(piece) and prefix.startswith(piece)


@dataclass(frozen=True, slots=True)
class HealingSplit:
    prompt_ids: list[int]  # what the engine runs
    removed_ids: list[int]
    prefix_text: str  # the text of removed_ids; generation must re-cover it

    @property
    def prefix_bytes(self) -> bytes:
        return self.prefix_text.encode("utf-8")


def split_prompt(
    prompt_ids: Sequence[int], table: VocabularyTable, max_removed: int = LIGHTLLM_HEALED_TOKENS
) -> HealingSplit | None:
    """Back the prompt up by up to `max_removed` tokens; None when nothing can be healed.

    At least one token always stays (a 1-token prompt is not healed: LightLLM's seed era emptied
    it). Special tokens are never removed, and the removed bytes must be whole UTF-8 characters
    (the prefix travels as text), else fewer tokens are removed.
    """
    num_removable = 0
    for token_id in reversed(prompt_ids[1:]):
        if num_removable == max_removed or not table.token_bytes[token_id]:
            break
        num_removable += 1
    for num_removed in range(num_removable, 0, -1):
        removed = list(prompt_ids[len(prompt_ids) - num_removed :])
        try:
            text = table.text_bytes(removed).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return HealingSplit(list(prompt_ids[: len(prompt_ids) - num_removed]), removed, text)
    return None


class TokenHealer:
    """Engine side: the allowed-token masks of the rows that are still healing.

    The vocabulary is loaded on the first healing request (`load` is called once), so servers
    that never heal pay nothing. Masks are cached per remaining prefix on the device.
    """

    def __init__(self, load: Callable[[], VocabularyTable]) -> None:
        self._load = load
        self._table: VocabularyTable | None = None
        self._masks: OrderedDict[tuple[bytes, int, str], torch.Tensor | None] = OrderedDict()

    @classmethod
    def for_table(cls, table: VocabularyTable) -> TokenHealer:
        healer = cls(lambda: table)
        healer._table = table
        return healer

    @property
    def table(self) -> VocabularyTable:
        if self._table is None:
            self._table = self._load()
        return self._table

    def blocked_rows(self, requests: Sequence[Request], vocab_width: int, device: torch.device) -> torch.Tensor | None:
        """[B, V] bool, True where a still-healing row may not pick the token; None if no row heals."""
        pending = [
            (row, r.params.healing_prefix, r.output_ids) for row, r in enumerate(requests) if r.params.healing_prefix
        ]
        if not pending:
            return None
        rows, masks = [], []
        for row, prefix_text, output_ids in pending:
            remaining = remaining_prefix(self.table, prefix_text.encode("utf-8"), output_ids)
            mask = self.blocked(remaining, vocab_width, device) if remaining else None
            if mask is not None:
                rows.append(row)
                masks.append(mask)
        if not rows:
            return None
        blocked = torch.zeros(len(requests), vocab_width, dtype=torch.bool, device=device)
        blocked[torch.tensor(rows, device=device)] = torch.stack(masks)
        return blocked

    def blocked(self, prefix: bytes, vocab_width: int, device: torch.device) -> torch.Tensor | None:
        """[V] bool: every id outside allowed(prefix) (ids past the tokenizer's size included).

        None when no token is allowed (a vocabulary without single-byte pieces): the row is left
        unconstrained rather than forced onto a -inf row.
        """
        key = (prefix, vocab_width, str(device))
        if key not in self._masks:
            allowed = [i for i in self.table.allowed_ids(prefix) if i < vocab_width]
            mask = None
            if allowed:
                mask = torch.ones(vocab_width, dtype=torch.bool)
                mask[allowed] = False
                mask = mask.to(device)
            self._masks[key] = mask
            if len(self._masks) > MASK_CACHE_SIZE:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return self._masks[key]
