"""Gemma3ForConditionalGeneration checkpoints (google/gemma-3-4b-it and up: a vision tower, a projector
and a Gemma 3 text model) on text-only input: the config of a hub-style sparse config.json, logits against
transformers' multimodal model, and greedy decoding through the real server (images: test_gemma3_vision.py)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from tests.modeling.helpers import TINY_SIZES, full_logits, max_rel_error, run_step, runner_for_folder
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.registry import describe_modeling_path

WINDOW = 8
TEXT = dict(
    TINY_SIZES,
    tie_word_embeddings=True,  # Gemma's own head
    num_hidden_layers=3,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    },
    final_logit_softcapping=3.0,
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def tiny_multimodal(vocab_size: int = 300, **wrapper) -> Gemma3ForConditionalGeneration:
    config = Gemma3Config(
        text_config={**TEXT, "vocab_size": vocab_size},
        vision_config=VISION,
        mm_tokens_per_image=4,
        image_token_index=vocab_size - 1,
        boi_token_index=vocab_size - 3,
        eoi_token_index=vocab_size - 2,
        **wrapper,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1) if "norm" not in name else param.uniform_(-0.5, 0.5)
    return model


def text_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def multimodal_pair(tmp_path_factory):
    model = tiny_multimodal()
    folder = tmp_path_factory.mktemp("gemma3-mm")
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    return model, runner_for_folder(str(folder))


def test_text_logits_match_transformers_multimodal_model(multimodal_pair):
    """A prompt longer than the window, then a chunk and decode steps over the cached prefix."""
    model, runner = multimodal_pair
    ids = torch.randint(0, 290, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = text_logits(model, ids)
    assert max_rel_error(full_logits(runner, ids), ref) <= 1e-4
    slots = list(range(100, 130))
    (first,) = run_step(runner, [(1, ids[:20], 0, slots[:20])])
    decodes = [run_step(runner, [(1, [ids[p]], p, [slots[p]])])[0] for p in range(20, 30)]
    assert max_rel_error(torch.cat([first, *decodes]), ref) <= 1e-4


def test_hub_style_sparse_config_takes_transformers_defaults():
    """gemma-3-4b-it's config.json lists only the text fields that differ from Gemma3TextConfig's
    defaults, and the generation ids at the top level."""
    hub = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    config = ModelConfig.from_hf_dict(hub)
    assert (config.architecture, config.multimodal_architecture) == (
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
    )
    assert (config.hidden_size, config.num_layers, config.sliding_window) == (2560, 34, 1024)
    assert (config.vocab_size, config.num_heads, config.num_kv_heads, config.head_dim) == (262208, 8, 4, 256)
    assert config.eos_token_ids == [1, 106] and config.qk_norm and config.tie_word_embeddings
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert describe_modeling_path("Gemma3ForConditionalGeneration") == (
        "native modeling of its text model Gemma3ForCausalLM and vision encoder"
    )


def test_greedy_through_the_server_equals_transformers_generate(tmp_path):
    from benchmarks.server_process import running_server
    from benchmarks.tokenizer import default_model_id, load_tokenizer
    from tests.benchmarks.conftest import free_port, launcher_path

    tokenizer = load_tokenizer(default_model_id())
    tokenizer.save_pretrained(tmp_path)
    model = tiny_multimodal(len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path)
    prompt = (
        "Multimodal checkpoints serve their text model here: this prompt is longer than two sliding windows of eight."
    )
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 2 * WINDOW
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
    eos = tokenizer.eos_token_id
    expected = expected[: expected.index(eos) + 1] if eos in expected else expected

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = f"{launcher_path()} --model-id {tmp_path} --port {port} --hostname 127.0.0.1"
    log = tmp_path / "server.log"
    with running_server(command, url, 300.0, log):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 32, "details": True}}
        response = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    assert [token["id"] for token in response["details"]["tokens"]] == expected
    assert (
        "Model Gemma3ForConditionalGeneration: native modeling of its text model Gemma3ForCausalLM and vision encoder"
        in log.read_text()
    )
