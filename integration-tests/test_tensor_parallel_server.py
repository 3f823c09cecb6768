"""--num-shard on the real launcher (CPU, gloo): 2 ranks (SmolLM2's 9 query heads split 6 + 3) answer
exactly as the session's one-rank server (greedy text of 20 prompts sent concurrently, best_of,
stop sequences, seeded sampling), and a killed rank makes the server unhealthy and exit non-zero,
leaving no process behind. A tiny Qwen2-MoE (experts split across the ranks) served by 2 ranks
picks transformers' greedy ids, and a hung (SIGSTOPped) rank makes the server unhealthy within
seconds and exit non-zero. A stopped (SIGTERM) sharded server exits 0 with every rank leaving on its own. (3 ranks and every family are proven equal at the logits level in
tests/modeling.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from harness import MAX_CONCURRENT_REQUESTS, Server, _free_port, _launcher_command, child_processes, launched
from test_model_families import PROMPTS as FAMILY_PROMPTS
from test_model_families import served_greedy, tiny_checkpoint, transformers_greedy

from tgi_compat.router.rank_heartbeat import HANG_TIMEOUT_ENV

# the MoE server's TGI_RANK_HANG_TIMEOUT_S: short, so the test waits less (the README's 10 s default is
# tests/router/test_rank_heartbeat.py's)
HANG_TIMEOUT_S = 5

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at",
    "The largest planet in the solar system is",
    "import numpy as np\n",
    "My favourite food is",
    "The quick brown fox",
    "In 1492, Columbus",
    "Photosynthesis is the process",
    "SELECT * FROM",
    "The meaning of life is",
    "A haiku about the sea:",
    "Two plus two equals",
    "The first law of thermodynamics",
    "Dear Sir or Madam,",
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
    "Rust and Python are",
]
SAMPLED = [
    {"max_new_tokens": 6, "do_sample": True, "seed": 7, "temperature": 0.9, "top_k": 30},
    # best_of may not take a seed (TGI); top_k=1 makes its sampled candidates deterministic
    {"max_new_tokens": 6, "best_of": 2, "do_sample": True, "top_k": 1, "details": True},
    {"max_new_tokens": 12, "stop": [".", "\n"], "details": True},
]


def _two_rank_command(*args: str) -> list[str]:
    """The launcher on a free port with `args`, at --num-shard 2 with a free rendezvous port."""
    return [*_launcher_command(_free_port()), *args, "--num-shard", "2", "--master-port", str(_free_port())]


@pytest.fixture(scope="module")
def sharded_server():
    with launched(_two_rank_command(), {**os.environ}, "launcher-tp2-") as handle:
        yield handle


async def _answers(base_url: str, bodies: list[dict]) -> list[dict]:
    limit = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS // 2)  # a best_of=2 request takes 2 of the permits
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:

        async def one(body: dict) -> dict:
            async with limit:
                response = await client.post("/generate", json=body)
                assert response.status_code == 200, response.text
                return response.json()

        return await asyncio.gather(*(one(body) for body in bodies))


async def _both(server: Server, sharded: Server, bodies: list[dict]) -> tuple[list[dict], list[dict]]:
    return await asyncio.gather(_answers(server.base_url, bodies), _answers(sharded.base_url, bodies))


async def test_greedy_text_is_the_same_as_one_rank(server, sharded_server):
    bodies = [{"inputs": prompt, "parameters": {"max_new_tokens": 5}} for prompt in PROMPTS]
    single, sharded = await _both(server, sharded_server, bodies)
    assert [a["generated_text"] for a in sharded] == [a["generated_text"] for a in single]


async def test_best_of_stop_sequences_and_seeded_sampling_are_the_same(server, sharded_server):
    bodies = [{"inputs": prompt, "parameters": params} for prompt in PROMPTS[:3] for params in SAMPLED]
    single, sharded = await _both(server, sharded_server, bodies)
    for ours, reference in zip(sharded, single, strict=True):
        assert ours["generated_text"] == reference["generated_text"]
        if "details" in reference:
            assert ours["details"]["finish_reason"] == reference["details"]["finish_reason"]
            assert [t["id"] for t in ours["details"]["tokens"]] == [t["id"] for t in reference["details"]["tokens"]]
            best_of = reference["details"].get("best_of_sequences")
            if best_of is not None:
                texts = [s["generated_text"] for s in ours["details"]["best_of_sequences"]]
                assert texts == [s["generated_text"] for s in best_of]


def test_a_killed_rank_fails_health_and_stops_the_server(sharded_server):
    """Runs last: it ends the module's server."""
    processes = _engine_processes(sharded_server)
    assert len(processes) == 2
    [rank_1] = [pid for pid in processes if Path(f"/proc/{pid}/comm").read_text().strip() == "tp-rank-1"]
    os.kill(rank_1, signal.SIGKILL)
    deadline = time.monotonic() + 30
    answers = []  # /health after the kill: 503 once the death is seen, then the port closes
    while sharded_server.process.poll() is None and time.monotonic() < deadline:
        try:
            answers.append(httpx.get(f"{sharded_server.base_url}/health", timeout=5).status_code)
        except httpx.TransportError:
            answers.append("closed")  # the port closed: the server is on its way out
        time.sleep(0.2)
    assert sharded_server.process.poll() not in (None, 0), sharded_server.log_tail()
    # a poll in the instant before the process watcher fires may still see recent progress (200);
    # after the first failing answer /health never reports healthy again
    failing = [i for i, answer in enumerate(answers) if answer != 200]
    assert failing and all(answer != 200 for answer in answers[failing[0] :]), answers
    assert "engine is dead: tensor-parallel tp-rank-1 process exited" in sharded_server.log_tail(10**6)
    time.sleep(1)
    assert [pid for pid in processes if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)] == []


@pytest.fixture(scope="module")
def sharded_moe(tmp_path_factory):
    """(server, transformers model, tokenizer): a tiny random Qwen2-MoE served by 2 ranks."""
    folder = tmp_path_factory.mktemp("qwen2-moe")
    model, tokenizer = tiny_checkpoint("qwen2-moe", str(folder))
    env = {**os.environ, HANG_TIMEOUT_ENV: str(HANG_TIMEOUT_S)}
    with launched(_two_rank_command("--model-id", str(folder)), env, "launcher-moe-tp2-") as handle:
        yield handle, model, tokenizer


async def test_sharded_moe_picks_transformers_greedy_ids(sharded_moe):
    server, model, tokenizer = sharded_moe
    expected = [transformers_greedy(model, tokenizer(p).input_ids, tokenizer.eos_token_id) for p in FAMILY_PROMPTS]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
        served = await asyncio.gather(*(served_greedy(client, p, stream=False) for p in FAMILY_PROMPTS))
    assert served == expected


def test_a_hung_rank_fails_health_within_seconds_and_stops_the_server(sharded_moe):
    """Runs after the MoE greedy test: it ends that server. A stopped process cannot beat."""
    server = sharded_moe[0]
    processes = _engine_processes(server)
    [rank_1] = [pid for pid in processes if Path(f"/proc/{pid}/comm").read_text().strip() == "tp-rank-1"]
    os.kill(rank_1, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        answers = []  # (seconds since the stop, /health status or "closed")
        while server.process.poll() is None and time.monotonic() - stopped_at < HANG_TIMEOUT_S + 20:
            try:
                status: int | str = httpx.get(f"{server.base_url}/health", timeout=5).status_code
            except httpx.TransportError:
                status = "closed"  # the port closed: the server is on its way out
            answers.append((time.monotonic() - stopped_at, status))
            time.sleep(0.2)
        assert server.process.poll() not in (None, 0), server.log_tail()
        failing = [i for i, (_, status) in enumerate(answers) if status != 200]
        assert failing and all(status != 200 for _, status in answers[failing[0] :]), answers
        assert answers[failing[0]][0] <= HANG_TIMEOUT_S + 3, answers
        assert "engine is dead: tensor-parallel tp-rank-1 process is hung" in server.log_tail(10**6)
        time.sleep(1)
        assert [pid for pid in processes if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)] == []
    finally:  # never leave a stopped process behind, whatever failed above
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank_1, signal.SIGKILL)


def _engine_processes(server: Server) -> list[int]:
    """The launcher's multiprocessing children: the engine (rank 0) and the other ranks."""
    return [pid for pid, cmdline in child_processes(server).items() if b"spawn_main" in cmdline]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_a_stopped_sharded_server_exits_with_every_rank_on_its_own(tmp_path):
    """SIGTERM (docker stop): rank 0 releases the other ranks, every engine process leaves within the client's
    wait, none is killed, and the launcher exits 0 with no process left behind."""
    model_folder = tmp_path / "qwen2-moe"
    tiny_checkpoint("qwen2-moe", str(model_folder))
    command = _two_rank_command("--model-id", str(model_folder))
    with launched(command, {**os.environ}, "launcher-tp2-stop-") as server:
        processes = _engine_processes(server)
        assert len(processes) == 2
        server.process.terminate()
        exit_code = server.process.wait(timeout=60)
    log = server.log_tail(10**6)
    assert exit_code == 0, log
    assert "did not exit within" not in log and "killing" not in log, log
    assert [pid for pid in processes if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)] == []
