"""TGI's offset-window detokenization and stop-string rules on the real SmolLM2 tokenizer."""

from __future__ import annotations

from tgi_compat.api.serving.detokenizer import IncrementalDetokenizer, StopStringMatcher


def _stream(tokenizer, prompt: str, continuation: str) -> tuple[list[str], str]:
    prompt_ids = tokenizer.encode_sync(prompt)
    ids = tokenizer.encode_sync(prompt + continuation)[len(prompt_ids) :]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    texts = [detokenizer.push(token_id) for token_id in ids]
    return texts, detokenizer.final_text()


def test_token_texts_concatenate_to_the_text_with_spaces(tokenizer):
    texts, final = _stream(tokenizer, "The capital of France is", " Paris, a city of light.")
    assert "".join(texts) == " Paris, a city of light."
    assert texts[0] == " Paris"
    assert final == " Paris, a city of light."


def test_multibyte_characters_wait_for_completion(tokenizer):
    texts, final = _stream(tokenizer, "Emoji:", " 🤗🤗 done")
    assert "".join(texts) == " 🤗🤗 done"
    assert "" in texts  # byte pieces of the emoji carry empty text
    assert all("\ufffd" not in text for text in texts)
    assert final == " 🤗🤗 done"


def test_short_prompt_clamps_prefix_offset(tokenizer):
    texts, _ = _stream(tokenizer, "Hi", " there friend")
    assert "".join(texts) == " there friend"


def test_special_tokens_keep_text_but_leave_generated_text(tokenizer):
    prompt_ids = tokenizer.encode_sync("Hello")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    words = tokenizer.encode_sync(" world", add_special_tokens=False)
    texts = [detokenizer.push(i) for i in [*words, tokenizer.eos_token_id]]
    assert texts[-1] == "<|im_end|>"
    assert detokenizer.final_text() == " world"


def test_final_text_is_empty_when_it_ends_mid_character(tokenizer):
    prompt_ids = tokenizer.encode_sync("Emoji:")
    emoji_ids = tokenizer.encode_sync("Emoji: 🤗")[len(prompt_ids) :]
    assert len(emoji_ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    for token_id in emoji_ids[:-1]:
        detokenizer.push(token_id)
    assert detokenizer.final_text() == ""  # TGI's quirk: a trailing U+FFFD empties the text


def test_stop_strings_match_at_the_end_only():
    matcher = StopStringMatcher(["stop", "a.b"])
    assert not matcher.push("no st")
    assert matcher.push("op")
    escaped = StopStringMatcher(["a.b"])
    assert not escaped.push("axb")
    assert escaped.push(" a.b")


def test_stop_string_dollar_matches_before_a_final_newline():
    matcher = StopStringMatcher(["end"])
    assert matcher.push("the end\n")  # Python's `$`, as in TGI's regex


def test_stop_buffer_keeps_the_last_200_characters():
    matcher = StopStringMatcher(["x" * 250])
    for _ in range(4):
        matched = matcher.push("x" * 100)
    assert not matched  # the buffer was trimmed to 200 characters
    assert not StopStringMatcher([])
