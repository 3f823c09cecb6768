"""Pooling models served end to end: tiny random embedding, classification and reward checkpoints (with a
byte-level tokenizer) behind the real launchers, answered through the openai client's `embeddings.create` and
plain HTTP for vLLM's /pooling and /classify and LightLLM's /get_score (InternLM2's reward model on 2
tensor-parallel ranks); every vector equals transformers' (or the InternLM2 reference's) on the same weights within
1e-4 (fp32). Generation on a pooling model, generation parameters and over-long
inputs get clear 422s."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from harness import MAX_CONCURRENT_REQUESTS, _free_port, _launcher_command, child_processes, launched
from test_model_families import byte_level_tokenizer

from tests.modeling.internlm2_reference import InternLM2Reference
from tests.modeling.pooling_models import hf_pooled, save_sentence_transformers_pooling, tiny_model

PROMPTS = ["The first prompt.", "A second, longer prompt of another length!", "x"]
VOCAB = 320  # the byte-level tokenizer's 258 ids fit


def checkpoint(folder: str, class_name: str, config_name: str, **overrides):
    tokenizer = byte_level_tokenizer()
    model = tiny_model(class_name, config_name, vocab_size=VOCAB, **overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def served(folder: str, prefix: str):
    return launched([*_launcher_command(_free_port()), "--model-id", folder], dict(os.environ), prefix)


def assert_close(ours: list[float], expected: torch.Tensor) -> None:
    assert (torch.tensor(ours) - expected).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("embedder"))
    model, tokenizer = checkpoint(folder, "Qwen2Model", "Qwen2Config")
    save_sentence_transformers_pooling(folder, "mean_tokens", normalize=True)
    with served(folder, "pooling-embed-") as server:
        yield server, model, tokenizer


def test_openai_client_embeddings_equal_transformers(embedding_server):
    server, model, tokenizer = embedding_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-")
    expected = [hf_pooled(model, tokenizer(p).input_ids, "mean", normalize=True) for p in PROMPTS]
    # the client asks for base64 by default and decodes it (little-endian float32) itself
    for encoding in (openai.NOT_GIVEN, "float"):
        response = client.embeddings.create(model="tgi", input=PROMPTS, encoding_format=encoding)
        assert [d.index for d in response.data] == [0, 1, 2]
        for data, reference in zip(response.data, expected):
            assert_close(data.embedding, reference)
        assert response.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in PROMPTS)
    ids = tokenizer(PROMPTS[1]).input_ids
    one = client.embeddings.create(model="tgi", input=ids)  # one prompt of token ids
    assert_close(one.data[0].embedding, expected[1])


def test_pooling_route_and_refusals_on_an_embedding_model(embedding_server):
    server, model, tokenizer = embedding_server
    pooled = httpx.post(f"{server.base_url}/pooling", json={"input": PROMPTS[0]}, timeout=60).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert_close(pooled["data"][0]["data"], hf_pooled(model, tokenizer(PROMPTS[0]).input_ids, "mean", True))

    def refusal(path: str, body: dict) -> str:
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert response.status_code == 422, response.text
        return response.json()["error"]

    assert "generates no text" in refusal("/generate", {"inputs": "hi"})
    assert "generates no text" in refusal("/v1/completions", {"model": "tgi", "prompt": "hi"})
    assert "`temperature` is a generation parameter" in refusal("/v1/embeddings", {"input": "hi", "temperature": 0.5})
    long = refusal("/v1/embeddings", {"input": "a" * 600})
    assert "maximum context length is 511 tokens. However, you requested 600 tokens" in long
    assert "does not serve /classify" in refusal("/classify", {"input": "hi"})
    cut = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "a" * 600, "truncate_prompt_tokens": 20})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 20
    # more prompts than permits: TGI's 429, before any prompt is tokenized (the over-long one is never read)
    many = httpx.post(
        f"{server.base_url}/v1/embeddings", json={"input": ["a" * 600] + ["hi"] * MAX_CONCURRENT_REQUESTS}
    )
    assert (many.status_code, many.json()) == (429, {"error": "Model is overloaded", "error_type": "overloaded"})
    assert (
        len(
            httpx.post(f"{server.base_url}/v1/embeddings", json={"input": ["hi"] * MAX_CONCURRENT_REQUESTS}).json()[
                "data"
            ]
        )
        == MAX_CONCURRENT_REQUESTS
    )


def test_classify_returns_transformers_probabilities(tmp_path):
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model, tokenizer = checkpoint(
        str(tmp_path), "LlamaForSequenceClassification", "LlamaConfig", num_labels=3, id2label=labels, pad_token_id=None
    )
    with served(str(tmp_path), "pooling-classify-") as server:
        body = httpx.post(f"{server.base_url}/classify", json={"model": "tgi", "input": PROMPTS}, timeout=60).json()
        refused = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert refused.status_code == 422
    for data, prompt in zip(body["data"], PROMPTS):
        probs = torch.softmax(hf_pooled(model, tokenizer(prompt).input_ids), dim=-1)
        assert_close(data["probs"], probs)
        assert data["num_classes"] == 3 and data["label"] == labels[int(probs.argmax())]


def test_lightllm_reward_model_scores_the_conversation(tmp_path):
    """LightLLM's InternLM2 reward model (`v_head` on the last token) served as LightLLM serves it, on 2
    tensor-parallel ranks (its decoder sharded, its head replicated)."""
    model = InternLM2Reference(reward=True, vocab_size=VOCAB)
    model.save(str(tmp_path))
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(str(tmp_path))
    port = _free_port()
    command = [sys.executable, "-m", "tgi_compat.api.cli.api_server", "--host", "127.0.0.1", "--port", str(port)]
    command += [
        "--model_dir",
        str(tmp_path),
        "--use_reward_model",
        "--max_req_total_len",
        "512",
        "--max_req_input_len",
        "500",
        "--tp",
        "2",
        "--nccl_port",
        str(_free_port()),
    ]
    chat = "<user>How much is 2+2?</user><assistant>4</assistant>"
    with launched(command, {**os.environ, "LOG_LEVEL": "info"}, "pooling-reward-") as server:
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in child_processes(server)}
        assert "tp-rank-1" in names  # the second rank serves beside the engine
        answer = httpx.post(f"{server.base_url}/get_score", json={"chat": chat}, timeout=60).json()
        refused = httpx.post(f"{server.base_url}/get_score", json={"chat": chat, "max_new_tokens": 4}, timeout=60)
    assert refused.status_code == 422 and "`max_new_tokens` is a generation parameter" in refused.json()["error"]
    ids = tokenizer(chat).input_ids
    assert answer["prompt_tokens"] == len(ids) and answer["finish_reason"] == "length"
    assert abs(answer["score"] - model.reward(ids).item()) <= 1e-4
