"""prepare_features: request parameters vs server defaults, truncation arithmetic applied to real
token ids, the healing split, and what the engine request receives."""

from __future__ import annotations

from types import SimpleNamespace

from tgi_compat.api.config import ServerConfig, ServingLimits
from tgi_compat.api.lightllm.features import prepare_features
from tgi_compat.api.protocol.tgi import GenerateParameters
from tgi_compat.router.request import GenerateRequest as EngineRequest


def make_state(tokenizer, **config_fields):
    config = ServerConfig(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", **config_fields)
    limits = ServingLimits.resolve(config, 64)  # max_total 64, max_input 63
    return SimpleNamespace(config=config, limits=limits, tokenizer=SimpleNamespace(tokenizer=tokenizer))


def params(**fields) -> GenerateParameters:
    return GenerateParameters.model_validate(fields)


async def test_request_mode_overrides_the_server_default(smollm2_tokenizer):
    state = make_state(smollm2_tokenizer, long_truncation_mode="head")
    ids = list(range(100, 180))
    kept, features = await prepare_features(state, params(max_new_tokens=4), ids)
    assert kept == ids[-60:] and features.truncated_prompt_tokens == 20  # min(63, 64 - 4) = 60
    kept, features = await prepare_features(state, params(max_new_tokens=4, long_truncation_mode="center"), ids)
    assert kept == ids[:30] + ids[-30:]
    kept, features = await prepare_features(state, params(max_new_tokens=4, long_truncation_mode="none"), ids)
    assert kept == ids and not features.reports_truncation


async def test_without_max_new_tokens_only_max_input_tokens_binds(smollm2_tokenizer):
    state = make_state(smollm2_tokenizer)
    kept, features = await prepare_features(state, params(long_truncation_mode="head"), list(range(70)))
    assert len(kept) == 63 and features.truncated_prompt_tokens == 7


async def test_healing_and_prompt_logprobs_fill_the_engine_request(smollm2_tokenizer):
    state = make_state(smollm2_tokenizer, token_healing=True)
    ids = smollm2_tokenizer("The capital of Fra")["input_ids"]
    kept, features = await prepare_features(
        state, params(max_new_tokens=5, return_all_prompt_logprobs=True, top_n_tokens=2), ids
    )
    assert kept == ids  # the validated prompt stays whole; only the engine request is healed
    request = EngineRequest("r", list(kept), max_new_tokens=5)
    features.apply_to(request)
    assert request.prompt_ids == ids[:2] and request.healing_prefix == " of Fra"
    assert request.max_new_tokens == 5  # the engine keeps re-covering tokens out of it (tests/router/test_stopping.py)
    assert request.prompt_logprobs and features.prompt_top_tokens


async def test_nothing_is_applied_by_default(smollm2_tokenizer):
    state = make_state(smollm2_tokenizer)
    ids = smollm2_tokenizer("The capital of Fra")["input_ids"]
    kept, features = await prepare_features(state, params(), ids)
    request = EngineRequest("r", list(kept), max_new_tokens=5)
    features.apply_to(request)
    assert request == EngineRequest("r", list(ids), max_new_tokens=5)
    assert features.output_filter() is None


def test_the_extensions_are_in_the_openapi_document():
    from tgi_compat.api.protocol.openapi import _component_schemas

    schemas = _component_schemas()
    parameters = schemas["GenerateParameters"]["properties"]
    for name in ("long_truncation_mode", "token_healing", "return_all_prompt_logprobs"):
        assert name in parameters
    assert {"head", "center", "none"} <= set(str(parameters["long_truncation_mode"]).replace("'", " ").split())
    for model in ("Details", "StreamDetails"):
        assert {"truncated_prompt_tokens", "prefill_top_tokens"} <= set(schemas[model]["properties"])
    assert "prefill" in schemas["StreamDetails"]["properties"]
