"""Speculative decoding on the real embedded SmolLM2: `--speculate 4` gives the tokens of `--speculate 0`,
greedy and seeded, all requests at once and each alone, and leaves the KV pool full."""

from __future__ import annotations

import pytest
from smollm2_cases import SMOLLM2_PROMPTS, smollm2_engine_config

from tgi_compat.router.request import SamplingParams
from tgi_compat.router.speculative.config import SpeculativeConfig

# Chat turns asking to copy text back: the answers repeat their prompts, so drafts get accepted.
COPY_PROMPTS = [
    # <|im_start|>user\nRepeat this list exactly: apple, banana, cherry, plum, apple, banana, cherry, plum ...
    [1, 4093, 198, 48010, 451, 1398, 3869, 42, 11977, 28, 21285, 28, 23636, 28, 18526, 28, 11977, 28, 21285, 28]
    + [23636, 28, 18526, 2, 198, 1, 520, 9531, 198],
    # <|im_start|>user\nCopy this code exactly:\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2)) ...
    [1, 4093, 198, 32601, 451, 2909, 3869, 42, 198, 1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278]
    + [198, 198, 3272, 24, 2104, 24, 33, 28, 216, 34, 1292, 2, 198, 1, 520, 9531, 198],
]
PROMPTS = SMOLLM2_PROMPTS[:6] + COPY_PROMPTS  # (CI's time: a batch of 8, each both ways)
MAX_NEW = 32
SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=5),
}


@pytest.fixture(scope="module")
def speculating_llm():
    from tgi_compat.router.offline import LLM

    return LLM(smollm2_engine_config(speculative=SpeculativeConfig(num_speculative_tokens=4)))


def _ids(results):
    return [(r.token_ids, r.finish_reason) for r in results]


@pytest.mark.parametrize("sampling", list(SAMPLINGS.values()), ids=list(SAMPLINGS))
def test_speculate_4_gives_the_tokens_of_speculate_0(smollm2_llm, speculating_llm, sampling):
    plain = smollm2_llm.generate(PROMPTS, sampling, max_new_tokens=MAX_NEW)
    before = speculating_llm.engine.scheduler.speculator.counters.num_accepted_tokens
    speculated = speculating_llm.generate(PROMPTS, sampling, max_new_tokens=MAX_NEW)
    assert _ids(speculated) == _ids(plain)
    for p, s in zip(plain, speculated):
        assert s.logprobs == pytest.approx(p.logprobs, abs=1e-4)
    assert speculating_llm.engine.scheduler.speculator.counters.num_accepted_tokens > before
    assert speculating_llm.engine.pool.is_full_free()
    for index in (1, len(PROMPTS) - 1):  # alone, against the batched plain run
        alone = speculating_llm.generate([PROMPTS[index]], sampling, max_new_tokens=MAX_NEW)
        assert _ids(alone) == _ids([plain[index]])
