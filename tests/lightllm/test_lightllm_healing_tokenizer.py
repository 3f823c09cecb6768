"""Token healing against SmolLM2's real (byte-level BPE) tokenizer: what is removed, what may be
generated, and how the API filters the regenerated text, for typical "broken" prompt ends."""

from __future__ import annotations

import pytest

from tgi_compat.api.lightllm.features import HealingOutput
from tgi_compat.api.serving.detokenizer import IncrementalDetokenizer
from tgi_compat.router.sampling.token_healing import remaining_prefix, split_prompt


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def test_vocabulary_bytes_reproduce_the_tokenizer_text(smollm2_tokenizer, smollm2_vocabulary):
    text = "The answer is (https://example.com/ünïcode)\n  done"
    ids = encode(smollm2_tokenizer, text)
    assert smollm2_vocabulary.text_bytes(ids).decode("utf-8") == text
    assert smollm2_vocabulary.token_bytes[2] == b""  # <|im_end|> is special: never a healing candidate


@pytest.mark.parametrize(
    "prompt, removed_text",
    [
        ("The answer is (", " is ("),
        ("Visit https:", ":"),  # "https" + ":" ... the last two tokens
        ("Hello ", " "),
        ("The capital of Fra", " of Fra"),
    ],
)
def test_split_removes_the_last_tokens_text(smollm2_tokenizer, smollm2_vocabulary, prompt, removed_text):
    ids = encode(smollm2_tokenizer, prompt)
    split = split_prompt(ids, smollm2_vocabulary)
    assert split is not None
    assert split.prompt_ids + split.removed_ids == ids
    assert prompt.endswith(split.prefix_text)
    assert split.prefix_text.endswith(removed_text)
    assert smollm2_vocabulary.text_bytes(split.prompt_ids).decode() + split.prefix_text == prompt


@pytest.mark.parametrize("prompt", ["The answer is (", "https:", "Hello ", "The capital of Fra"])
def test_every_allowed_token_is_consistent_with_the_removed_text(smollm2_tokenizer, smollm2_vocabulary, prompt):
    split = split_prompt(encode(smollm2_tokenizer, prompt), smollm2_vocabulary)
    prefix = split.prefix_bytes
    allowed = smollm2_vocabulary.allowed_ids(prefix)
    assert allowed and set(split.removed_ids[:1]) <= set(allowed)  # re-emitting the prompt is allowed
    for token_id in allowed:
        piece = smollm2_vocabulary.token_bytes[token_id]
        assert piece.startswith(prefix) or (prefix.startswith(piece) and piece)
    # and nothing consistent is missing
    expected = {
        i
        for i, piece in enumerate(smollm2_vocabulary.token_bytes)
        if piece and (piece.startswith(prefix) or prefix.startswith(piece))
    }
    assert set(allowed) == expected


def test_https_colon_can_become_scheme_separator(smollm2_tokenizer, smollm2_vocabulary):
    split = split_prompt(encode(smollm2_tokenizer, "https:"), smollm2_vocabulary)
    allowed_text = {smollm2_vocabulary.token_bytes[i] for i in smollm2_vocabulary.allowed_ids(split.prefix_bytes)}
    assert b"://" in allowed_text


def _filtered(tokenizer, vocabulary, prompt: str, generated_text: str) -> tuple[list[int], list[str], str]:
    """Drive the API filter over the ids a model could produce for prompt-without-tail + generated."""
    split = split_prompt(encode(tokenizer, prompt), vocabulary)
    continuation = tokenizer(split.prefix_text + generated_text, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, split.prompt_ids)
    output = HealingOutput(vocabulary, split.prefix_text)
    counted, texts = [], []
    for token_id in continuation:
        counts, text = output.push(token_id, detokenizer.push(token_id))
        if counts:
            counted.append(token_id)
            texts.append(text)
    return counted, texts, output.final_text(detokenizer.final_text())


@pytest.mark.parametrize(
    "prompt, generated",
    [
        ("The answer is (", "42)."),
        ("https:", "//example.com"),
        ("The capital of Fra", "nce is Paris."),
        ("Hello ", "world"),
    ],
)
def test_streamed_text_never_repeats_the_prompt(smollm2_tokenizer, smollm2_vocabulary, prompt, generated):
    counted, texts, final = _filtered(smollm2_tokenizer, smollm2_vocabulary, prompt, generated)
    assert "".join(texts) == generated
    assert final == generated
    assert all(texts)  # tokens that only re-cover the prompt are dropped, not emitted empty


def test_prefix_only_tokens_are_not_counted(smollm2_tokenizer, smollm2_vocabulary):
    # " of Fra" is re-generated as " of" + " France": " of" only re-covers the prompt
    counted, texts, _ = _filtered(smollm2_tokenizer, smollm2_vocabulary, "The capital of Fra", "nce")
    assert [smollm2_vocabulary.token_bytes[i] for i in counted] == [b" France"]
    assert texts == ["nce"]


def test_engine_and_api_agree_on_progress(smollm2_tokenizer, smollm2_vocabulary):
    split = split_prompt(encode(smollm2_tokenizer, "The capital of Fra"), smollm2_vocabulary)
    of, france = smollm2_tokenizer(" of France", add_special_tokens=False)["input_ids"]
    assert remaining_prefix(smollm2_vocabulary, split.prefix_bytes, [of]) == b" Fra"
    assert remaining_prefix(smollm2_vocabulary, split.prefix_bytes, [of, france]) == b""
