"""return_all_prompt_logprobs: the engine's prompt logprobs (and top alternatives) equal
transformers' on the same weights at every prompt position, also when the prompt is chunked."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.router.request import SamplingParams

PROMPT_TEXTS = ["The capital of France is Paris, and the capital of Germany is", "def fibonacci(n):\n    if n <"]


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[L-1, V]: log_softmax at positions 0..L-2, which score prompt tokens 1..L-1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


@pytest.mark.parametrize("text", PROMPT_TEXTS)
def test_every_prompt_position_matches_transformers(smollm2_engine_llm, smollm2_hf_model, smollm2_tokenizer, text):
    ids = smollm2_tokenizer(text)["input_ids"]
    result = smollm2_engine_llm.generate([ids], SamplingParams(top_n_tokens=3), max_new_tokens=1, prompt_logprobs=True)[
        0
    ]
    reference = reference_logprobs(smollm2_hf_model, ids)
    expected = reference.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    assert result.prompt_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(ids)
    ours = torch.tensor(result.prompt_logprobs[1:], dtype=torch.float64)
    theirs = torch.tensor(expected, dtype=torch.float64)
    relative = ((ours - theirs).abs() / theirs.abs().clamp(min=1e-3)).max().item()
    assert relative <= 1e-4, f"max relative error {relative:.2e}"


def test_prompt_top_alternatives_match_transformers(smollm2_engine_llm, smollm2_hf_model, smollm2_tokenizer):
    ids = smollm2_tokenizer(PROMPT_TEXTS[0])["input_ids"]
    engine = smollm2_engine_llm.engine
    from tgi_compat.router.request import GenerateRequest

    top_3 = SamplingParams(top_n_tokens=3)
    engine.add_request(GenerateRequest("prompt-top", ids, top_3, max_new_tokens=1, prompt_logprobs=True))
    first = None
    while engine.has_unfinished():
        for event in engine.step():
            if event.request_id == "prompt-top" and first is None:
                first = event
    reference = reference_logprobs(smollm2_hf_model, ids)
    assert first.prompt_top_tokens[0] == []
    for position, top in enumerate(first.prompt_top_tokens[1:]):
        values, top_ids = reference[position].topk(3)
        assert [t.token_id for t in top][:3] == top_ids.tolist()
        assert [t.logprob for t in top][:3] == pytest.approx(values.tolist(), rel=1e-4, abs=1e-5)
