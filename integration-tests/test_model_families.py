"""Every model family served end to end: a tiny random checkpoint of each, saved to a temporary
folder with a byte-level tokenizer, served by the real launcher; concurrent greedy requests over
/generate and /generate_stream must pick exactly the ids transformers' `generate` picks.

The prompts are longer than the windowed families' sliding window, and Gemma 2's soft-caps are
small enough to bite, so those paths are exercised through the engine's chunking and batching.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
import torch
from harness import _free_port, _launcher_command, launched

from tests.modeling.helpers import TINY_SIZES
from tests.modeling.helpers import transformers_greedy as greedy_ids

MAX_NEW_TOKENS = 32
PROMPTS = [
    "Sliding windows must hide what lies behind them.",
    "A second prompt, of another length, in the same batch!",
    "short one",
]
WINDOW = 8
FALLBACK_FAMILIES = {"olmo2", "gpt-neox"}


def _families() -> dict[str, tuple[str, dict]]:
    """family -> (transformers config class name, config overrides). Gemma 3 and the other MoE
    families share these model files (their logits are checked in tests/modeling); OLMo-2 and
    GPT-NeoX have no native file and take the transformers fallback."""
    return {
        "gemma2": (
            "Gemma2Config",
            dict(
                head_dim=16,
                sliding_window=WINDOW,
                query_pre_attn_scalar=16,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
            ),
        ),
        "phi3": ("Phi3Config", {}),
        "qwen2-moe": (
            "Qwen2MoeConfig",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96),
        ),
        "olmo2": ("Olmo2Config", {}),
        "gpt-neox": ("GPTNeoXConfig", dict(num_key_value_heads=4, rotary_pct=0.5)),
    }


def byte_level_tokenizer():
    """256 byte tokens plus <bos>/<eos>: any text encodes, and the vocabulary fits a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")


def tiny_checkpoint(family: str, folder: str):
    """Saves a random fp32 model of `family` and the tokenizer into folder; returns the model."""
    import transformers

    config_name, overrides = _families()[family]
    tokenizer = byte_level_tokenizer()
    sizes = {**TINY_SIZES, "vocab_size": 320}
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = getattr(transformers, config_name)(
        **{**sizes, **overrides}, **special, pad_token_id=special["eos_token_id"]
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def transformers_greedy(model, ids: list[int], eos_id: int) -> list[int]:
    return greedy_ids(model, ids, eos_id, MAX_NEW_TOKENS)


async def served_greedy(client: httpx.AsyncClient, prompt: str, stream: bool) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True}}
    if not stream:
        response = await client.post("/generate", json=body)
        response.raise_for_status()
        return [token["id"] for token in response.json()["details"]["tokens"]]
    ids = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
    return ids


@pytest.mark.parametrize(
    "family",
    # OLMo-2 on the transformers fallback is in the smoke set of `make test-latest`
    [pytest.param(f, marks=pytest.mark.latest_deps) if f == "olmo2" else f for f in sorted(_families())],
)
def test_family_serves_transformers_greedy_ids(family, tmp_path):
    model, tokenizer = tiny_checkpoint(family, str(tmp_path))
    expected = [transformers_greedy(model, tokenizer(p).input_ids, tokenizer.eos_token_id) for p in PROMPTS]
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > WINDOW
    assert all(len(ids) == MAX_NEW_TOKENS for ids in expected)  # no early eos: all 32 tokens compared

    async def drive(base_url: str) -> list[list[int]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            calls = [served_greedy(client, p, stream) for stream in (False, True) for p in PROMPTS]
            return await asyncio.gather(*calls)

    command = [*_launcher_command(_free_port()), "--model-id", str(tmp_path)]
    with launched(command, {**os.environ, "LOG_LEVEL": "info"}, f"family-{family}-") as server:
        served = asyncio.run(drive(server.base_url))
        info = httpx.get(f"{server.base_url}/info").json()
        log = server.log_tail(1 << 20)
    assert served == expected + expected
    assert info["model_id"] == str(tmp_path)
    path = "transformers" if family in FALLBACK_FAMILIES else "native"
    assert f"{model.config.architectures[0]}: {path} modeling" in log  # the startup log says which path
