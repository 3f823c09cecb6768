"""Beam search over the real engine (in process, prefix cache on) against transformers' `generate(num_beams=...)`
on a tiny random Llama: the same best sequence token for token and its score within 1e-4, for each
length_penalty / early_stopping mode, with an EOS id that some beams reach early."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaConfig

from tests.modeling.beam_reference import transformers_beams
from tests.modeling.helpers import saved_checkpoint, tiny_hf_model
from tgi_compat.api.serving.beam_search import BeamSearchParams, beam_search
from tgi_compat.router.client_in_process import InProcessEngineClient
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine_loop import load_engine

PROMPT = [5, 17, 200, 33, 91, 4, 150]
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    model = tiny_hf_model(LlamaConfig)
    folder = saved_checkpoint(model, tmp_path_factory, "beam-llama")
    with torch.no_grad():  # an EOS that greedy decoding reaches at its 3rd token: some beams end early
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False, eos_token_id=None)
    return model, folder, int(greedy[0, -1])


@pytest.mark.parametrize(
    ("num_beams", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (3, 0.5, True), (4, 2.0, "never"), (3, -1.0, False)],
)
def test_best_beam_equals_transformers(tiny_llama, num_beams, length_penalty, early_stopping):
    model, folder, eos = tiny_llama
    params = BeamSearchParams(num_beams, MAX_NEW_TOKENS, length_penalty, early_stopping, frozenset({eos}))

    async def run():
        engine = load_engine(EngineConfig(model_id=folder, device="cpu", dtype="float32", max_batch_total_tokens=2048))
        client = InProcessEngineClient(engine)
        try:
            return await beam_search(client, PROMPT, params)
        finally:
            await client.shutdown()

    best = asyncio.run(run())[0]
    ((expected_ids, expected_score),) = transformers_beams(
        model, PROMPT, num_beams, MAX_NEW_TOKENS, eos, length_penalty=length_penalty, early_stopping=early_stopping
    )
    padded = best.token_ids + [eos] * (len(expected_ids) - len(best.token_ids))  # transformers pads with eos here
    assert padded == expected_ids
    assert abs(best.score - expected_score) <= 1e-4
