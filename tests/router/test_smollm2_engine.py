"""The engine with the real embedded SmolLM2: transformers parity, batching invariance, subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from smollm2_cases import SMOLLM2_MAX_NEW, SMOLLM2_PROMPTS, smollm2_engine_config

from tgi_compat.router.client import ZmqEngineClient
from tgi_compat.router.client_api import EngineDeadError
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.request import GenerateRequest, SamplingParams


def test_greedy_ids_equal_transformers_generate(smollm2_greedy, smollm2_hf_model):
    for prompt, ours in zip(SMOLLM2_PROMPTS, smollm2_greedy):
        with torch.inference_mode():
            out = smollm2_hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=SMOLLM2_MAX_NEW,
                do_sample=False,
            )
        theirs = out[0, len(prompt) :].tolist()  # stops at EOS; ours ran on (ignore_eos)
        assert len(theirs) >= 5 and ours[: len(theirs)] == theirs, prompt


def test_a_request_alone_equals_it_in_a_batch(smollm2_llm, smollm2_greedy):
    for index in (0, 7, 10):
        alone = smollm2_llm.generate([SMOLLM2_PROMPTS[index]], max_new_tokens=SMOLLM2_MAX_NEW, ignore_eos=True)[0]
        assert alone.token_ids == smollm2_greedy[index]


def test_offline_reports_logprobs_and_frees_the_pool(smollm2_llm, smollm2_greedy):
    results = smollm2_llm.generate(
        SMOLLM2_PROMPTS[:3], SamplingParams(top_n_tokens=3), max_new_tokens=4, ignore_eos=True, prompt_logprobs=True
    )
    for result, greedy in zip(results, smollm2_greedy):
        assert result.token_ids == greedy[:4]
        assert all(lp <= 0 for lp in result.logprobs)
        # greedy: the chosen token is the best alternative, with the same logprob
        assert [top[0].token_id for top in result.top_tokens] == result.token_ids
        assert [top[0].logprob for top in result.top_tokens] == pytest.approx(result.logprobs)
        assert len(result.prompt_logprobs) == len(result.prompt_ids) and result.prompt_logprobs[0] is None
    assert smollm2_llm.engine.pool.is_full_free()


async def collect(client, request):
    return [t async for e in client.generate(request) for t in e.token_ids]


async def test_engine_process_serves_32_concurrent_requests(smollm2_greedy):
    client = await ZmqEngineClient.start(smollm2_engine_config())
    try:
        assert client.info.vocab_size == 49152 and 2 in client.info.eos_token_ids
        requests = [
            GenerateRequest(
                f"r{i}", SMOLLM2_PROMPTS[i % len(SMOLLM2_PROMPTS)], max_new_tokens=SMOLLM2_MAX_NEW, ignore_eos=True
            )
            for i in range(32)
        ]
        outputs = await asyncio.gather(*(collect(client, r) for r in requests))
        for i, output in enumerate(outputs):
            assert output == smollm2_greedy[i % len(SMOLLM2_PROMPTS)], f"request {i}"
        assert await client.check_health()
    finally:
        await client.shutdown()


async def test_killed_engine_fails_pending_requests_fast_and_restarts(tiny_llama_dir):
    client = await ZmqEngineClient.start(
        EngineConfig(model_id=tiny_llama_dir, max_batch_total_tokens=2048, max_running_requests=8)
    )
    try:
        streams = [
            client.generate(GenerateRequest(f"long{i}", [5, 6, 7 + i], max_new_tokens=400, ignore_eos=True))
            for i in range(2)
        ]
        await streams[0].__anext__()
        os.kill(client._process.pid, signal.SIGKILL)
        started = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="exited"):
                async for _ in stream:
                    pass
        assert time.monotonic() - started < 5
        assert client.is_dead and not await client.check_health()
        with pytest.raises(EngineDeadError):
            await collect(client, GenerateRequest("after", [5, 6], max_new_tokens=2))

        await client.restart()
        assert not client.is_dead and await client.check_health()
        assert len(await collect(client, GenerateRequest("again", [5, 6], max_new_tokens=3, ignore_eos=True))) == 3
    finally:
        await client.shutdown()
