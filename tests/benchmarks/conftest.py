"""Real servers for the benchmark tests: the launcher on the embedded SmolLM2 GGUF (shared), and a
tiny random-weight Llama folder (SmolLM2 tokenizer) for the offline transformers comparison."""

import os
import socket
import sys
from pathlib import Path

import pytest

from benchmarks.random_model import write_random_llama
from benchmarks.server_process import running_server
from benchmarks.tokenizer import default_model_id, load_tokenizer

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_path() -> Path:
    return Path(sys.executable).parent / "text-generation-launcher"


@pytest.fixture(scope="session")
def server_url(tmp_path_factory) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = f"{launcher_path()} --model-id {default_model_id()} --port {port} --hostname 127.0.0.1"
    log = tmp_path_factory.mktemp("server") / "server.log"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with running_server(command, url, STARTUP_TIMEOUT_S, log):
        yield url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """2 layers, hidden 64, the SmolLM2 vocabulary: loads in a second in both our server and transformers."""
    tokenizer = load_tokenizer(default_model_id())
    tokenizer_dir = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    write_random_llama(
        model_dir,
        "llama3-tiny",
        "cpu",
        "float32",
        tokenizer_dir,
        overrides=dict(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
        ),
    )
    return model_dir


@pytest.fixture
def tiny_server_cmd(tiny_model_dir) -> tuple[str, str]:
    """(launcher command line, base URL) for a server on the tiny model; the test starts it."""
    port = free_port()
    command = f"{launcher_path()} --model-id {tiny_model_dir} --port {port} --hostname 127.0.0.1"
    return command, f"http://127.0.0.1:{port}"
