"""LoRA adapters on the real launcher (embedded SmolLM2): TGI's --lora-adapters and vLLM's --lora-modules, a
request's adapter picked by `adapter_id` (HTTP, huggingface_hub) or `model` (openai), an unknown
adapter refused with the loaded ones named while the server keeps serving, and vLLM's runtime routes
(VLLM_ALLOW_RUNTIME_LORA_UPDATING) loading and unloading adapters while a stream runs. With --num-shard 2 (CPU,
gloo) the startup adapters answer as on one rank, and runtime loads are refused with the reason."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import httpx
import pytest
from harness import _free_port, _launcher_command, launched

from tests.lora_adapters import write_smollm2_adapter  # (the repository root is on the path, as for tests/)

PROMPT = "The capital of France is"
PARAMS = {"max_new_tokens": 8, "details": True}


RUNTIME_UPDATES = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture(scope="module")
def adapter_flags(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("lora-server")
    a1, a2 = write_smollm2_adapter(root / "a1", 8, seed=1), write_smollm2_adapter(root / "a2", 16, seed=2)
    return ["--lora-adapters", f"a1={a1}", "--lora-modules", f"a2={a2}"]


@pytest.fixture(scope="module")
def lora_server(adapter_flags):
    with launched([*_launcher_command(_free_port()), *adapter_flags], RUNTIME_UPDATES, "launcher-lora-") as handle:
        yield handle


def _generate(server, adapter_id: str | None) -> dict:
    body = {"inputs": PROMPT, "parameters": {**PARAMS, "adapter_id": adapter_id}}
    answer = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _logprobs(answer: dict) -> list[float]:
    return [token["logprob"] for token in answer["details"]["tokens"]]


def test_adapter_id_through_http_and_huggingface_hub(lora_server):
    from huggingface_hub import InferenceClient

    base, a1, a2 = (_generate(lora_server, name) for name in (None, "a1", "a2"))
    assert _logprobs(a1) != _logprobs(base) and _logprobs(a2) != _logprobs(a1)
    # (text-generation 0.7.0, the newest on PyPI, has no adapter_id argument: its raw body is the HTTP one above)
    hub = InferenceClient(lora_server.base_url, timeout=120)
    assert (
        hub.text_generation(PROMPT, adapter_id="a2", max_new_tokens=8, return_full_text=False) == a2["generated_text"]
    )


def test_model_through_openai(lora_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="-")
    completion = client.completions.create(model="a1", prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text == _generate(lora_server, "a1")["generated_text"]
    chat = [{"role": "user", "content": "Say hi."}]
    under_a2 = client.chat.completions.create(model="a2", messages=chat, max_tokens=8, temperature=0)
    under_base = client.chat.completions.create(model="tgi", messages=chat, max_tokens=8, temperature=0)
    assert under_a2.choices[0].message.content and under_base.choices[0].message.content


def test_unknown_adapter_is_refused_and_the_server_keeps_serving(lora_server):
    body = {"inputs": PROMPT, "parameters": {**PARAMS, "adapter_id": "nope"}}
    answer = httpx.post(f"{lora_server.base_url}/generate", json=body, timeout=120)
    assert answer.status_code == 422, answer.text
    assert "'nope' is not loaded; loaded: a1, a2" in answer.json()["error"]
    assert _generate(lora_server, None)["details"]["generated_tokens"] >= 1


def _stream_in_background(server, ended: list[float]) -> threading.Thread:
    """A long /generate_stream; `ended` gets the time its last event arrived."""

    def consume() -> None:
        body = {"inputs": "Count from one to fifty: one, two,", "parameters": {"max_new_tokens": 40}}
        with httpx.stream("POST", f"{server.base_url}/generate_stream", json=body, timeout=300) as stream:
            events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
        assert events[-1]["generated_text"] is not None
        ended.append(time.monotonic())

    thread = threading.Thread(target=consume)
    thread.start()
    return thread


def test_load_while_streaming_use_then_unload(lora_server, tmp_path):
    from huggingface_hub import InferenceClient
    from openai import OpenAI, UnprocessableEntityError

    url, path = lora_server.base_url, str(tmp_path / "a2-copy")
    write_smollm2_adapter(tmp_path / "a2-copy", 16, seed=2)  # a2's weights: the same answers under a new name
    ended: list[float] = []
    stream = _stream_in_background(lora_server, ended)
    time.sleep(1.0)  # the stream is decoding
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path}, timeout=120)
    loaded_at = time.monotonic()
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'late' added successfully.")
    stream.join()
    assert ended and loaded_at < ended[0]  # loaded while the stream still ran, and it finished

    cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}
    assert cards["late"]["root"] == path and cards["late"]["parent"] == cards["late"]["owned_by"]
    assert {"a1", "a2", "late"} <= set(cards)
    a2 = _generate(lora_server, "a2")
    assert _generate(lora_server, "late")["generated_text"] == a2["generated_text"]
    hub = InferenceClient(url, timeout=120)
    assert (
        hub.text_generation(PROMPT, adapter_id="late", max_new_tokens=8, return_full_text=False) == a2["generated_text"]
    )
    client = OpenAI(base_url=f"{url}/v1", api_key="-")
    completion = client.completions.create(model="late", prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text == a2["generated_text"]

    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
    assert "late" not in {card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]}
    body = {"inputs": PROMPT, "parameters": {**PARAMS, "adapter_id": "late"}}
    refused = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert refused.status_code == 422 and "'late' is not loaded; loaded: a1, a2" in refused.json()["error"]
    with pytest.raises(UnprocessableEntityError) as by_model:
        client.completions.create(model="late", prompt=PROMPT, max_tokens=8)
    assert "'late' is not loaded; loaded: a1, a2" in by_model.value.response.json()["error"]
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"


def test_malformed_and_missing_adapters_get_clear_errors(lora_server, tmp_path):
    url = lora_server.base_url
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": true}')
    for source, status, reason in (
        (broken, 400, "use_dora=True is not supported"),
        (tmp_path / "none", 404, "no such folder"),
    ):
        body = {"lora_name": "bad", "lora_path": str(source)}
        answer = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
        assert answer.status_code == status and reason in answer.json()["error"]["message"], answer.text
    taken = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(broken)}, timeout=60)
    assert taken.status_code == 400 and "'a1' has already been loaded" in taken.json()["error"]["message"]
    assert _generate(lora_server, "a1")["details"]["generated_tokens"] >= 1  # the server keeps serving


def test_load_inplace_replaces_an_adapter_and_a_bad_one_changes_nothing(lora_server, tmp_path):
    """vLLM's `load_inplace`: the name's new requests get the new files' weights; without it the name is taken."""
    url = lora_server.base_url
    first, second = write_smollm2_adapter(tmp_path / "1", 8, seed=1), write_smollm2_adapter(tmp_path / "2", 16, seed=2)
    a1, a2 = _generate(lora_server, "a1")["generated_text"], _generate(lora_server, "a2")["generated_text"]
    assert a1 != a2

    def load(path, **extra) -> httpx.Response:
        body = {"lora_name": "swap", "lora_path": str(path), **extra}
        return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120)

    assert load(first).status_code == 200 and _generate(lora_server, "swap")["generated_text"] == a1
    taken = load(second)
    assert taken.status_code == 400 and "'swap' has already been loaded" in taken.json()["error"]["message"]
    replaced = load(second, load_inplace=True)
    assert (replaced.status_code, replaced.text) == (200, "Success: LoRA adapter 'swap' added successfully.")
    assert _generate(lora_server, "swap")["generated_text"] == a2
    cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}
    assert cards["swap"]["root"] == str(second)
    bad = load(tmp_path / "none", load_inplace=True)
    assert bad.status_code == 404 and _generate(lora_server, "swap")["generated_text"] == a2  # still the last one
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "swap"}, timeout=60).status_code == 200


def _lora_info(server) -> tuple[str, list[str]]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return text, [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]


def test_lora_requests_info_names_the_running_adapter(lora_server):
    """vLLM's gauge as the Gateway API Inference Extension reads it, while a request runs: the newest series (the
    one kept) names its adapter, with max_lora; AIAK's adapter count and per-adapter latency."""
    body = {"inputs": "Count from one to fifty: one, two,", "parameters": {"max_new_tokens": 120, "adapter_id": "a1"}}
    running: list[list[str]] = []

    def read_while_it_runs() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not running:
            _, series = _lora_info(lora_server)
            if any('running_lora_adapters="a1"' in line for line in series):
                running.append(series)
            time.sleep(0.05)

    reader = threading.Thread(target=read_while_it_runs)
    reader.start()
    assert httpx.post(f"{lora_server.base_url}/generate", json=body, timeout=300).status_code == 200
    reader.join()
    assert running and len(running[0]) == 1 and 'max_lora="2"' in running[0][0], running
    text, series = _lora_info(lora_server)
    assert len(series) == 1 and 'running_lora_adapters=""' in series[0], series  # idle now: the old one is gone
    # AIAK's: the adapters loaded, and a latency histogram per adapter that served a request
    assert re.search(r'^vllm:lora_count\{model_name="[^"]*"\} 2(\.0)?$', text, re.M), text
    assert re.search(r'^vllm:lora_time_e2e_requests_count\{model_name="[^"]*",lora_name="a1"\} [1-9]', text, re.M)


def test_two_ranks_answer_as_one_and_load_while_serving(lora_server, adapter_flags):
    """Each rank reads every adapter rank 0 loads (at startup or while serving); a step's adapter slots reach both
    ranks."""
    command = [*_launcher_command(_free_port()), *adapter_flags, "--num-shard", "2", "--master-port", str(_free_port())]
    with launched(command, RUNTIME_UPDATES, "launcher-lora-tp2-") as sharded:
        for adapter in (None, "a1", "a2"):
            ours, reference = _generate(sharded, adapter), _generate(lora_server, adapter)
            assert ours["generated_text"] == reference["generated_text"], adapter
            assert _logprobs(ours) == pytest.approx(_logprobs(reference), abs=1e-3), adapter
        a1_path = adapter_flags[1].split("=", 1)[1]
        body = {"lora_name": "late", "lora_path": a1_path}
        loaded = httpx.post(f"{sharded.base_url}/v1/load_lora_adapter", json=body, timeout=60)
        assert loaded.status_code == 200, loaded.text
        late, reference = _generate(sharded, "late"), _generate(lora_server, "a1")  # the same files as a1
        assert late["generated_text"] == reference["generated_text"]
        unloaded = httpx.post(f"{sharded.base_url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
        assert unloaded.status_code == 200, unloaded.text
        assert _generate(sharded, "a1")["details"]["generated_tokens"] >= 1  # still serving
