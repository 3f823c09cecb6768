"""Token healing against hand-built vocabularies: byte decoding, allowed sets, prompt splitting,
progress through the removed text, and the engine-side masks."""

from __future__ import annotations

import torch

from tgi_compat.router.request import GenerateRequest, Request
from tgi_compat.router.sampling.token_healing import (
    TokenHealer,
    VocabularyTable,
    byte_level_bytes,
    is_prefix_only,
    remaining_prefix,
    sentencepiece_bytes,
    split_prompt,
)

# id:      0        1     2      3     4       5        6       7        8       9      10
PIECES = ["<eos>", "Ġ", "Ġh", "Ġhe", "Ġhel", "Ġhello", "Ġhelp", "lo", "Ġworld", "Ġ(", 'Ġ("']
PIECES += ["x", "Ġis", "Ġi", "https", ":", "://", ":/", "ĠÃ", "Ċ"]  # 11..20 (Ã = byte 0xC3, Ċ = \n)
TABLE = VocabularyTable.from_pieces(PIECES, byte_level=True, special_ids=[0])


def ids_of(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def test_byte_level_and_sentencepiece_pieces_decode_to_bytes():
    assert byte_level_bytes("Ġhello") == b" hello"
    assert byte_level_bytes("Ċ") == b"\n"
    assert byte_level_bytes("Ã") == b"\xc3"  # half of a UTF-8 character
    assert byte_level_bytes("<|im_end|>") == b"<|im_end|>"
    assert sentencepiece_bytes("\u2581hello") == b" hello"
    assert sentencepiece_bytes("<0x0A>") == b"\n"
    assert sentencepiece_bytes("<0xZZ>") == b"<0xZZ>"


def test_allowed_ids_extend_the_prefix_or_are_a_proper_prefix_of_it():
    assert sorted(TABLE.allowed_ids(b" hel")) == ids_of("Ġ", "Ġh", "Ġhe", "Ġhel", "Ġhello", "Ġhelp")
    assert sorted(TABLE.allowed_ids(b" (")) == ids_of("Ġ", "Ġ(", 'Ġ("')
    assert sorted(TABLE.allowed_ids(b":")) == ids_of(":", "://", ":/")
    # specials never (the eos piece stands for no text)
    assert 0 not in TABLE.allowed_ids(b"<")


def test_split_removes_two_tokens_and_keeps_at_least_one():
    split = split_prompt(ids_of("x", "Ġis", "Ġ("), TABLE)
    assert split.prompt_ids == ids_of("x") and split.removed_ids == ids_of("Ġis", "Ġ(")
    assert split.prefix_text == " is ("
    two = split_prompt(ids_of("https", ":"), TABLE)
    assert two.prompt_ids == ids_of("https") and two.prefix_text == ":"
    assert split_prompt(ids_of("x"), TABLE) is None  # a 1-token prompt is not healed


def test_split_never_removes_special_tokens_or_half_characters():
    assert split_prompt([*ids_of("x"), 0], TABLE) is None
    assert split_prompt(ids_of("x", "Ġhel") + [0], TABLE) is None
    # "ĠÃ" ends in half a UTF-8 character: only whole characters travel as the prefix text
    assert split_prompt(ids_of("x", "Ġhel", "ĠÃ"), TABLE) is None
    assert split_prompt(ids_of("x", "ĠÃ", "Ġhel"), TABLE).prefix_text == " hel"


def test_remaining_prefix_shrinks_then_clears():
    prefix = b" hel"
    assert remaining_prefix(TABLE, prefix, []) == b" hel"
    assert remaining_prefix(TABLE, prefix, ids_of("Ġ")) == b"hel"
    assert remaining_prefix(TABLE, prefix, ids_of("Ġh")) == b"el"
    assert remaining_prefix(TABLE, prefix, ids_of("Ġhello")) == b""
    assert remaining_prefix(TABLE, prefix, ids_of("Ġhel")) == b""  # exact cover
    assert remaining_prefix(TABLE, prefix, ids_of("Ġh", "x")) == b""  # an unconstrained token ends it
    assert is_prefix_only(TABLE, prefix, ids_of("Ġhel")[0])
    assert not is_prefix_only(TABLE, prefix, ids_of("Ġhello")[0])


def _request(prefix: str | None, output: list[int]) -> Request:
    request = Request(GenerateRequest("r", [11], healing_prefix=prefix), arrival=0)
    request.output_ids = list(output)
    return request


def test_healer_masks_only_rows_still_healing():
    healer = TokenHealer.for_table(TABLE)
    requests = [
        _request(" hel", []),
        _request(None, []),
        _request(" hel", ids_of("Ġhelp")),
        _request(" hel", ids_of("Ġh")),
    ]
    blocked = healer.blocked_rows(requests, vocab_width=24, device=torch.device("cpu"))
    assert blocked.shape == (4, 24)
    assert sorted((~blocked[0]).nonzero().flatten().tolist()) == ids_of("Ġ", "Ġh", "Ġhe", "Ġhel", "Ġhello", "Ġhelp")
    assert not blocked[1].any() and not blocked[2].any()
    # "el" is left and nothing in this vocabulary covers it: the row is left unconstrained
    assert not blocked[3].any()
    assert blocked[0, 20:].all()  # columns past the tokenizer's size are never allowed
    assert healer.blocked_rows([_request(None, [])], 24, torch.device("cpu")) is None


def test_healer_loads_the_vocabulary_once_and_only_when_needed():
    calls = []

    def load():
        calls.append(1)
        return TABLE

    healer = TokenHealer(load)
    assert healer.blocked_rows([_request(None, [])], 24, torch.device("cpu")) is None
    assert calls == []
    healer.blocked_rows([_request(" (", [])], 24, torch.device("cpu"))
    healer.blocked_rows([_request(" (", [])], 24, torch.device("cpu"))
    assert calls == [1]


def test_sentencepiece_vocabulary_with_byte_fallback():
    pieces = ["<unk>", "<s>", "</s>", "\u2581The", "\u2581ans", "\u2581answer", "\u2581(", "\u2581", "<0x28>", "wer"]
    table = VocabularyTable.from_pieces(pieces, byte_level=False, special_ids=[0, 1, 2])
    split = split_prompt([1, 3, 4], table)  # <s> ▁The ▁ans: the BOS stays, two tokens go
    assert split.prompt_ids == [1] and split.prefix_text == " The ans"  # the dummy-prefix space too
    split = split_prompt([1, 3, 6], table, max_removed=1)
    assert split.prefix_text == " ("
    # "▁" is a proper prefix of " (", "▁(" covers it; the byte token "(" alone does not start with " "
    assert sorted(table.allowed_ids(b" (")) == [6, 7]
    assert remaining_prefix(table, b" (", [7, 8]) == b""
    assert remaining_prefix(table, b" (", [7]) == b"("
