"""GET routes, /tokenize, transport-level behaviour (404/405, API key, CORS)."""

from __future__ import annotations

PROMPT = "What is the capital of France?"


async def test_info_has_tgi_keys(client):
    info = (await client.get("/info")).json()
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["router"] == "text-generation-router" and info["version"] == "3.3.6-dev0"
    assert (info["max_input_tokens"], info["max_total_tokens"], info["max_best_of"]) == (63, 64, 2)
    for key in ("model_sha", "model_pipeline_tag", "sha", "docker_label"):
        assert info[key] is None
    for key in ("max_concurrent_requests", "max_stop_sequences", "validation_workers", "max_client_batch_size"):
        assert isinstance(info[key], int)


async def test_health_follows_the_engine(client, engine):
    for path in ("/health", "/ping", "/"):
        response = await client.get(path)
        assert (response.status_code, response.content) == (200, b"")
    engine.healthy = False
    response = await client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}


async def test_models_and_metrics(client):
    models = (await client.get("/v1/models")).json()
    model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert models == {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": model_id}],
    }
    metrics = await client.get("/metrics")
    assert metrics.headers["content-type"] == "text/plain; charset=utf-8"


async def test_tokenize_reports_byte_offsets(client):
    text = "Héllo wörld"
    tokens = (await client.post("/tokenize", json={"inputs": text})).json()
    raw = text.encode()
    assert [t["start"] for t in tokens][0] == 0 and tokens[-1]["stop"] == len(raw)
    for token in tokens:
        assert set(token) == {"id", "text", "start", "stop"}
        assert token["text"] == raw[token["start"] : token["stop"]].decode(errors="replace")


async def test_unknown_path_and_wrong_method_have_empty_bodies(client):
    missing = await client.post("/nope", json={})
    assert (missing.status_code, missing.content) == (404, b"")
    wrong = await client.get("/generate")
    assert (wrong.status_code, wrong.content) == (405, b"")


async def test_api_key_guards_generation_routes_only(make_client, engine):
    async with make_client(engine, api_key="secret") as http:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
        denied = await http.post("/generate", json=body)
        assert (denied.status_code, denied.content) == (401, b"")
        assert (await http.post("/tokenize", json=body)).status_code == 401
        allowed = await http.post("/generate", json=body, headers={"Authorization": "BEARER SECRET"})
        assert allowed.status_code == 200
        for path in ("/health", "/info", "/metrics", "/v1/models"):
            assert (await http.get(path)).status_code == 200


async def test_openapi_uses_tgi_schema_names(client):
    document = (await client.get("/api-doc/openapi.json")).json()
    schemas = document["components"]["schemas"]
    for name in ("GenerateRequest", "GenerateParameters", "GenerateResponse", "Details", "StreamResponse", "Info"):
        assert name in schemas
    assert "/generate" in document["paths"]
    assert (await client.get("/docs")).status_code == 200


async def test_invocations_dispatches_like_tgi(client):
    compat = await client.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert compat.status_code == 200 and isinstance(compat.json(), list)
    assert compat.json()[0]["generated_text"].startswith(PROMPT)  # the compat default applies
    completion = await client.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    neither = await client.post("/invocations", json={"foo": 1})
    assert neither.status_code == 422 and "untagged enum SagemakerRequest" in neither.text


async def test_head_works_on_get_routes(client):
    for path in ("/health", "/info"):
        assert (await client.head(path)).status_code == 200
