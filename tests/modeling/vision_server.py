"""The real server (TGI's launcher) over a tiny random vision checkpoint on the SmolLM2 tokenizer with the model's
image tokens added, and the prompt-and-greedy-ids reference to hold its answers against: the fixture body shared
by tests/modeling/test_*_vision_server.py and test_qwen2_5_vl_server.py."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from PIL import Image

# (url, transformers' model, tokenizer, image processor), as the tests' `served` fixtures yield it
Served = tuple[str, Any, Any, Any]


@contextmanager
def serving(
    folder: Path, image_tokens: list[str], image_token: str, build_model: Callable[..., Any], processor, flags: str
) -> Iterator[Served]:
    """Writes the checkpoint (`build_model(vocab, eos_token_id=...)`, whose `image_token` id must be the added
    token's) into `folder` and serves it with the launcher's `flags`."""
    from benchmarks.server_process import running_server
    from tests.benchmarks.conftest import free_port

    model, tokenizer = write_checkpoint(folder, image_tokens, image_token, build_model, processor)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the worktree's package (python -m from the repo root), not an installed one
    launcher = f"{sys.executable} -m tgi_compat.launcher {flags}"
    command = f"{launcher} --model-id {folder} --port {port} --hostname 127.0.0.1"
    with running_server(command, url, 300.0, folder / "server.log"):
        yield url, model, tokenizer, processor


def write_checkpoint(
    folder: Path, image_tokens: list[str], image_token: str, build_model: Callable[..., Any], processor
) -> tuple[Any, Any]:
    """The SmolLM2 tokenizer with `image_tokens` added, `build_model(vocab, eos_token_id=...)` (whose `image_token` id
    must be the added token's) and `processor`, written into `folder`; (the model, the tokenizer)."""
    from benchmarks.tokenizer import default_model_id, load_tokenizer

    tokenizer = load_tokenizer(default_model_id())
    tokenizer.add_special_tokens({"additional_special_tokens": image_tokens})
    tokenizer.save_pretrained(folder)
    model = build_model(len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.convert_tokens_to_ids(image_token) == model.config.image_token_id
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, tokenizer


def greedy_until_eos(
    served: Served, text: str, images: list[bytes], reference: Callable[..., list[int]], add_special_tokens: bool
) -> tuple[list[int], list[int]]:
    """(prompt ids, `reference(model, ids, processed)`'s greedy ids cut after the first eos) for `text` with its
    images already expanded to their placeholder tokens."""
    _, model, tokenizer, processor = served
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    out = reference(model, ids, processor(images=pictures, return_tensors="pt"))
    eos = tokenizer.eos_token_id
    return ids, out[: out.index(eos) + 1] if eos in out else out


def generate_greedy(
    served: Served,
    text: str,
    images: list[bytes],
    image_keys: tuple[str, ...],
    new_tokens: int,
    add_special_tokens: bool,
) -> tuple[list[int], list[int]]:
    """`greedy_until_eos` with transformers' `generate` as the reference, given the processor outputs (`image_keys`)
    that the model takes."""

    def reference(model, ids: list[int], processed) -> list[int]:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **{key: processed[key] for key in image_keys},
                max_new_tokens=new_tokens,
                do_sample=False,
            )
        return out[0, len(ids) :].tolist()

    return greedy_until_eos(served, text, images, reference, add_special_tokens)


def streamed_ids(url: str, body: dict) -> list[int]:
    """The token ids of a /generate_stream answer, event by event."""
    ids = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
    return ids


def generate_details(url: str, inputs: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prefill ids, generated ids) of a /generate answer (the server needs --enable-prefill-logprobs)."""
    body = {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "decoder_input_details": True}}
    details = httpx.post(f"{url}/generate", json=body, timeout=120).json()["details"]
    return [token["id"] for token in details["prefill"]], [token["id"] for token in details["tokens"]]


# an image as the tests make it: (data URL, file bytes, (width, height))
TestImage = tuple[str, bytes, tuple[int, int]]


def check_two_images(served: Served, greedy, image_text: Callable[[tuple[int, int]], str], images: list[TestImage]):
    """/generate with two markdown images answers `greedy(served, text, files)`'s (prompt ids, ids) for the text with
    each image replaced by `image_text(its size)`: the prefill's placeholders included."""
    first, second = images
    inputs = f"![]({first[0]})What is this?![]({second[0]})And this?"
    text = f"{image_text(first[2])}What is this?{image_text(second[2])}And this?"
    ids, expected = greedy(served, text, [first[1], second[1]])
    assert generate_details(served[0], inputs, len(expected)) == (ids, expected)
