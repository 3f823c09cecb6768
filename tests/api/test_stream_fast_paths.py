"""The streaming hot path's shortcuts give exactly what the general code gives."""

from __future__ import annotations

import random

import pytest

from tgi_compat.api.protocol.tgi import Token
from tgi_compat.api.serving.generation import TokenStep
from tgi_compat.api.serving.responses import stream_event_json, stream_response

TEXTS = ["", "a", " hello", '"quoted" \\ slash', "é漢\n\t\x00\u2028", "😀", "\ufffd"]
LOGPROBS = [None, 0.0, -0.0, -1e-05, -1e-07, -123.456, -3.4028234663852886e38]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("logprob", LOGPROBS)
@pytest.mark.parametrize("special", [False, True])
def test_plain_token_event_matches_the_pydantic_dump(text, logprob, special):
    step = TokenStep(index=7, token=Token(id=49151, text=text, logprob=logprob, special=special), top_tokens=[])
    assert stream_event_json(None, step) == stream_response(None, step).to_json()


def test_raw_decode_matches_transformers(tokenizer, smollm2_tokenizer):
    assert tokenizer._raw_decode is not None  # SmolLM2 does no cleanup, so the shortcut is taken
    rng = random.Random(0)
    special = sorted(tokenizer.special_ids)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(49152) for _ in range(rng.randrange(12))]
        for skip in (False, True):
            assert tokenizer.decode(ids, skip) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
