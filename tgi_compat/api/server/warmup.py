"""Start-up warm-up: every step shape the engine will meet runs once before the port opens.

Triton compiles a kernel per specialisation (sizes equal to 1, divisible by 16, or neither), and
the first mixed prefill+decode step, the first chunked prompt and the first batch past the largest
CUDA graph each pay for compilation. The warm-up sends real requests through the real engine in
waves that produce those steps: prompts of lengths around the specialisation boundaries, decodes
joined by new prompts (mixed steps), every sampling processor with top-n logprobs, and on a GPU a
full batch of long prompts (chunked prefill, the widest decode). With LoRA adapters loaded at startup the second
wave runs under the first of them. On a CPU it stays to two short
prompts per wave (nothing compiles there; they prove every path runs).

A vision model then runs its image path (`warm_up_images`), which no text prompt reaches: the image processor's load,
the vision tower's kernels at its widths, and the image steps' own (Qwen-VL's M-RoPE rotary), on a GPU with more
image prompts at once than one prefill chunk holds.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import logging
import time
import uuid

import numpy as np
from PIL import Image

from tgi_compat.api.protocol.images import image_markdown
from tgi_compat.api.serving.images import VisionPrompts
from tgi_compat.api.serving.tokenization import TokenizerService
from tgi_compat.router.client_api import EngineClient
from tgi_compat.router.images import PromptImage
from tgi_compat.router.request import GenerateRequest, SamplingParams

logger = logging.getLogger("tgi_compat.warmup")

PROMPT_LENGTHS = (1, 7, 16, 17, 100, 256, 1000)
CPU_PROMPT_LENGTHS = (1, 17)  # nothing compiles on a CPU: the paths only need to run once
NEW_TOKENS = 4
GPU_BATCH = 64  # the widest burst the GPU warm-up runs (capped by the engine's limits)
GPU_PROMPT_LENGTH = 256
SAMPLING = SamplingParams(
    do_sample=True,
    temperature=0.7,
    top_k=10,
    top_p=0.9,
    typical_p=0.95,
    repetition_penalty=1.1,
    frequency_penalty=0.1,
    seed=0,
    top_n_tokens=2,
)


IMAGE_SIDE = 448  # the GPU's warm-up images, in pixels
CPU_IMAGE_SIDE = 112
# image prompts at once on a GPU: past one 4,096-token prefill chunk (Qwen2.5-VL: 256 placeholders for 448 px), so that
# full chunks with images and prefills beside decodes run too
GPU_IMAGE_PROMPTS = 16
IMAGE_TEXT = "What is in this picture?"


def _prompt(seed_ids: list[int], length: int) -> list[int]:
    return list(itertools.islice(itertools.cycle(seed_ids or [0]), length))


def _request(
    prompt_ids: list[int],
    sampling: SamplingParams | None = None,
    adapter: str | None = None,
    images: list[PromptImage] | None = None,
) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"warmup-{uuid.uuid4().hex}",
        prompt_ids=prompt_ids,
        sampling=sampling or SamplingParams(),
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        adapter_id=adapter,
        images=images or [],
    )


async def _run(engine: EngineClient, request: GenerateRequest, first_token: asyncio.Event | None = None) -> None:
    async for event in engine.generate(request):
        if event.error is not None:
            raise RuntimeError(f"warmup failed: {event.error}")
        if first_token is not None:
            first_token.set()
        if event.finish_reason is not None:
            return
    raise RuntimeError("warmup failed: the engine stream ended without finishing")


async def warm_up(
    engine: EngineClient, seed_ids: list[int], max_input_tokens: int, max_total_tokens: int, max_batch_size: int
) -> float:
    """Run the warm-up waves; returns the seconds it took."""
    started = time.perf_counter()
    on_gpu = engine.info.device.startswith("cuda")
    longest = max(1, min(max_input_tokens, max_total_tokens - NEW_TOKENS))
    lengths = sorted({min(length, longest) for length in (PROMPT_LENGTHS if on_gpu else CPU_PROMPT_LENGTHS)})
    num_requests = 2 * len(lengths)
    # Wave 1: one multi-prompt prefill, then its decodes; halfway, wave 2 joins (mixed steps),
    # with every sampling processor and top-n logprobs.
    decoding = asyncio.Event()
    first = [asyncio.create_task(_run(engine, _request(_prompt(seed_ids, n)), decoding)) for n in lengths]
    await decoding.wait()
    # under an adapter loaded at startup, if any: the LoRA kernels' prefill, mixed and decode shapes too
    adapter = next(iter(engine.info.lora_adapters), None)
    second = [_run(engine, _request(_prompt(seed_ids, n), SAMPLING, adapter)) for n in lengths]
    await asyncio.gather(*first, *second)
    if on_gpu:
        batch = max(1, min(GPU_BATCH, max_batch_size))
        prompt = _prompt(seed_ids, min(GPU_PROMPT_LENGTH, longest))
        await asyncio.gather(*(_run(engine, _request(prompt)) for _ in range(batch)))
        num_requests += batch
    elapsed = time.perf_counter() - started
    logger.info("Warm-up: %d requests of every step shape in %.1f s", num_requests, elapsed)
    return elapsed


def _png_data_url(side: int, seed: int) -> str:
    """A noise picture (a different one per seed: no encoder-cache or prefix-cache hit between them)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def warm_up_images(
    engine: EngineClient,
    vision: VisionPrompts,
    tokenizer: TokenizerService,
    max_input_tokens: int,
    max_batch_size: int,
) -> int:
    """A vision model's image prompts, through the API's own image expansion; returns how many ran (none where one
    does not fit `max_input_tokens`, or `--max-images` is 0)."""
    on_gpu = engine.info.device.startswith("cuda")
    count = max(1, min(GPU_IMAGE_PROMPTS, max_batch_size)) if on_gpu else 1
    side = IMAGE_SIDE if on_gpu else CPU_IMAGE_SIDE
    if vision.max_images == 0:
        return 0
    await asyncio.to_thread(vision.fetcher.decoded.decoder.warm)  # the API's image decoders up, where it has any
    requests = []
    for seed in range(count):
        text, loaded = await vision.expand(image_markdown(_png_data_url(side, seed)) + IMAGE_TEXT)
        ids = tokenizer.encode_sync(text, vision.adds_special_tokens)
        if len(ids) > max_input_tokens:
            logger.info("Warm-up: no image prompts (one takes %d tokens, more than --max-input-tokens)", len(ids))
            return 0
        requests.append(_request(ids, images=vision.place(ids, loaded)))
    started = time.perf_counter()
    await asyncio.gather(*(_run(engine, request) for request in requests))
    logger.info("Warm-up: %d image prompts in %.1f s", len(requests), time.perf_counter() - started)
    return len(requests)
