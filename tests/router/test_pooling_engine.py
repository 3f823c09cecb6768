"""The prefill-only engine of a pooling model, on a tiny random classifier: requests of different lengths
batched into flat steps under the token budget, each answered once with transformers' scores; over-long
and out-of-vocabulary prompts refused; the in-process client carries the scores."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.modeling.pooling_models import hf_pooled, tiny_model
from tgi_compat.router.client_api import Refusal, RequestRejectedError
from tgi_compat.router.client_in_process import InProcessEngineClient
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine_loop import load_engine
from tgi_compat.router.pooling_engine import PoolingEngineCore
from tgi_compat.router.request import GenerateRequest


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = tmp_path_factory.mktemp("classifier")
    model = tiny_model(
        "Qwen2ForSequenceClassification", "Qwen2Config", num_labels=3, pad_token_id=0, id2label={0: "a", 1: "b", 2: "c"}
    )
    model.save_pretrained(folder)
    return model, str(folder)


def engine_for(folder: str, **overrides) -> PoolingEngineCore:
    fields = dict(model_id=folder, device="cpu", dtype="float32", max_batch_total_tokens=256, max_total_tokens=64)
    engine = load_engine(EngineConfig(**(fields | overrides)))
    assert isinstance(engine, PoolingEngineCore)
    return engine


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, 256, (3 + 4 * i,), generator=generator).tolist() for i in range(count)]


def test_steps_pack_prompts_under_the_token_budget_and_answer_each_once(classifier):
    model, folder = classifier
    engine = engine_for(folder, max_batch_prefill_tokens=24)
    assert engine.info.pooling_task == "classify" and engine.info.labels == ("a", "b", "c")
    batch_prompts = prompts(5)  # 3, 7, 11, 15, 19 tokens
    for i, ids in enumerate(batch_prompts):
        engine.add_request(GenerateRequest(f"r{i}", ids, max_new_tokens=1))
    steps = []
    while engine.has_unfinished():
        events, _ = engine.run_once()
        steps.append([e.request_id for e in events])
    assert steps == [["r0", "r1", "r2"], ["r3"], ["r4"]]  # 21 tokens, then 15 (+19 > 24), then 19
    engine.add_request(GenerateRequest("again", batch_prompts[2], max_new_tokens=1))
    (event,), _ = engine.run_once()
    assert event.finish_reason == "length" and event.num_prompt_tokens == 11
    expected = hf_pooled(model, batch_prompts[2])
    assert (torch.tensor(event.pooled) - expected).abs().max().item() <= 1e-4


def test_over_long_and_bad_prompts_are_refused(classifier):
    _, folder = classifier
    engine = engine_for(folder)
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_request(GenerateRequest("long", [1] * 64, max_new_tokens=1))
    assert (refused.value.reason, refused.value.values) == (Refusal.TOTAL_TOKENS, (64, 64, 1))
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_request(GenerateRequest("bad", [1, 999], max_new_tokens=1))
    assert refused.value.reason is Refusal.PROMPT_TOKEN and refused.value.values[0] == 999
    engine.add_request(GenerateRequest("gone", [1, 2], max_new_tokens=1))
    engine.abort("gone")
    assert not engine.has_unfinished()


def test_in_process_client_streams_one_scored_event_per_request(classifier):
    model, folder = classifier
    batch_prompts = prompts(4)

    async def run():
        client = InProcessEngineClient(engine_for(folder))
        try:

            async def score(i: int, ids: list[int]):
                return [e async for e in client.generate(GenerateRequest(f"c{i}", ids, max_new_tokens=1))]

            return await asyncio.gather(*(score(i, ids) for i, ids in enumerate(batch_prompts)))
        finally:
            await client.shutdown()

    for ids, events in zip(batch_prompts, asyncio.run(run())):
        assert len(events) == 1
        assert (torch.tensor(events[0].pooled) - hf_pooled(model, ids)).abs().max().item() <= 1e-4


def test_a_failing_prompt_fails_alone(classifier):
    """A batch that raises is run again request by request: only the request that fails gets an error."""
    model, folder = classifier
    engine = engine_for(folder)
    pool = engine.runner.pool

    def pool_unless_poisoned(batch):
        if 99 in batch.input_ids.tolist():
            raise RuntimeError("poisoned prompt")
        return pool(batch)

    engine.runner.pool = pool_unless_poisoned  # type: ignore[method-assign]
    batch_prompts = [[5, 6, 7], [8, 99, 9], [10, 11]]
    for i, ids in enumerate(batch_prompts):
        engine.add_request(GenerateRequest(f"p{i}", ids, max_new_tokens=1))
    events, _ = engine.run_once()
    by_id = {e.request_id: e for e in events}
    assert by_id["p1"].finish_reason == "error" and "poisoned prompt" in by_id["p1"].error
    for i in (0, 2):
        assert (torch.tensor(by_id[f"p{i}"].pooled) - hf_pooled(model, batch_prompts[i])).abs().max().item() <= 1e-4
