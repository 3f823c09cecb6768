"""Token healing in the engine on SmolLM2: the first generated tokens re-cover the removed prompt
text, for greedy and sampled decoding, with the mask applied before the other processors."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.router.request import GenerateRequest, Request, SamplingParams
from tgi_compat.router.sampling.batch import SamplingBatch
from tgi_compat.router.sampling.sampler import Sampler
from tgi_compat.router.sampling.token_healing import TokenHealer, remaining_prefix, split_prompt

PROMPTS = ["The capital of Fra", "Visit https:", "The answer is (", "I like to eat apples and "]


def run_batch(llm, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    """All requests in one continuous batch (each with its own healing prefix); ids per request."""
    for request in requests:
        llm.engine.add_request(request)
    tokens: dict[str, list[int]] = {request.request_id: [] for request in requests}
    while llm.engine.has_unfinished():
        for event in llm.engine.step():
            tokens[event.request_id] += event.token_ids
    return tokens


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(do_sample=True, seed=7), SamplingParams(temperature=1.5, top_k=50, seed=3)],
    ids=["greedy", "sampled", "warped"],
)
def test_generation_re_covers_the_removed_text(smollm2_engine_llm, smollm2_tokenizer, smollm2_vocabulary, sampling):
    splits = [split_prompt(smollm2_tokenizer(p)["input_ids"], smollm2_vocabulary) for p in PROMPTS]
    requests = [
        GenerateRequest(f"heal-{i}", split.prompt_ids, sampling, max_new_tokens=6, healing_prefix=split.prefix_text)
        for i, split in enumerate(splits)
    ]
    tokens = run_batch(smollm2_engine_llm, requests)
    for request, split in zip(requests, splits):
        generated = smollm2_vocabulary.text_bytes(tokens[request.request_id])
        assert generated.startswith(split.prefix_bytes), (split.prefix_text, generated)
        assert remaining_prefix(smollm2_vocabulary, split.prefix_bytes, tokens[request.request_id]) == b""


def test_unhealed_requests_in_the_same_batch_are_unconstrained(
    smollm2_engine_llm, smollm2_tokenizer, smollm2_vocabulary
):
    prompt = smollm2_tokenizer("The capital of Fra")["input_ids"]
    split = split_prompt(prompt, smollm2_vocabulary)
    alone = smollm2_engine_llm.generate([split.prompt_ids], max_new_tokens=4)[0].token_ids
    tokens = run_batch(
        smollm2_engine_llm,
        [
            GenerateRequest("healed", split.prompt_ids, max_new_tokens=4, healing_prefix=split.prefix_text),
            GenerateRequest("plain", split.prompt_ids, max_new_tokens=4),
        ],
    )
    assert tokens["plain"] == alone
    assert smollm2_vocabulary.text_bytes(tokens["healed"]).startswith(split.prefix_bytes)


def test_mask_comes_before_top_k(smollm2_vocabulary):
    """top_k=1 after the mask picks the best *allowed* token, never a masked one."""
    vocab = smollm2_vocabulary.size
    healer = TokenHealer.for_table(smollm2_vocabulary)
    request = Request(
        GenerateRequest("r", [504], SamplingParams(top_k=1, seed=1), healing_prefix=" (a"), arrival=0, seed=1
    )
    logits = torch.zeros(1, vocab)
    logits[0, 42] = 100.0  # ":" would win unconstrained
    allowed = smollm2_vocabulary.allowed_ids(b" (a")
    logits[0, allowed[-1]] = 5.0
    batch = SamplingBatch.build([request], vocab, torch.device("cpu"), healer)
    out = Sampler(vocab, "cpu")(logits, batch).to_host()[0]
    assert out.token_id == allowed[-1]
    assert out.logprob == pytest.approx(0.0, abs=1e-4)  # the only survivor of top-k=1


def test_healed_prompts_served_from_the_prefix_cache_give_the_same_tokens(
    smollm2_engine_llm, smollm2_tokenizer, smollm2_vocabulary
):
    splits = [split_prompt(smollm2_tokenizer(p)["input_ids"], smollm2_vocabulary) for p in PROMPTS]

    def requests(tag: str) -> list[GenerateRequest]:
        return [
            GenerateRequest(f"{tag}{i}", split.prompt_ids, max_new_tokens=6, healing_prefix=split.prefix_text)
            for i, split in enumerate(splits)
        ]

    pool = smollm2_engine_llm.engine.pool
    first = run_batch(smollm2_engine_llm, requests("a"))
    hits = pool.num_prefix_hit_tokens
    again = run_batch(smollm2_engine_llm, requests("b"))  # every healed prompt is cached now
    assert pool.num_prefix_hit_tokens - hits >= sum(len(s.prompt_ids) - 1 for s in splits)
    assert [again[f"b{i}"] for i in range(len(splits))] == [first[f"a{i}"] for i in range(len(splits))]
