"""Qwen2.5-VL (or Qwen2-VL) time to first token with images (not CI; in-process EngineCore, no HTTP): issue 41's GPU
numbers.

    python3 -m benchmarks.device.qwen_vl                    # Qwen2.5-VL-7B shape, random weights, one H200: ~3 min
    python3 -m benchmarks.device.qwen_vl --family qwen2_vl --skip-plain   # Qwen2-VL-7B shape (its vision tower)
    python3 -m benchmarks.device.qwen_vl --device cpu --preset tiny --streams 2 --new 4   # the CPU smoke (a test)

The model is the 7B's config.json with `--load-format dummy` (random weights made on the device; nothing read
from disk) and transformers' Qwen2-VL image processor at the released min/max_pixels. Phases, each on the same
engine, every prompt `--text` random ids around one image (or its stand-in):

* images: `--streams` requests at once, each with its own random `--size` x `--size` PNG (no encoder-cache or
  prefix-cache hit), `--new` tokens out: TTFT p50/p90 and output tok/s. The clock starts when the PNGs (as data
  URLs) are handed to a process of the API's own, whose fetch threads load them as the server's do (base64, Pillow's
  decode, Qwen-VL's resize); each request goes to the engine once its image is back;
* text: the same with each image's placeholders replaced by as many random text ids (the same prompt length);
* images, preprocessed: new images resized before the clock starts (what the images cost without the API's host
  work), then cached: new text around those same images, whose rows the encoder cache holds (no prefix-cache hit:
  what the image path costs the forward without the encoder);
* repeat: one request with a new image, then the same prompt again, both through the API's process: its TTFT
  against the first (the API's kept decoded images, the prefix cache and the encoder cache serve the second);
* text-only on the VL engine against a plain Qwen2 engine of the same text shape (`--skip-plain` to save ~30 s);
* encoder: ms per image of the API's host half (Pillow decode + resize, in this process, one at a time) and of the
  vision encoder alone (its upload, patch flattening and normalisation not included), with 1 and 8 images a call.

Targets (issue 41): images TTFT p50 <= 1.5x text's, repeat <= 0.3x first, text-only within 3% of plain Qwen2.
A markdown table on stdout, JSON in $OUT/qwen_vl.json.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import gc
import hashlib
import io
import json
import multiprocessing
import os
import queue
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.device.timing import out_path, write_json
from benchmarks.shapes import QWEN2_7B
from tgi_compat.api.protocol.images import ImageRef, decode_image, image_markdown
from tgi_compat.api.serving.image_decode import ImageDecoder, decode_processes
from tgi_compat.api.serving.image_fetch import DecodedImages, ImageFetcher
from tgi_compat.api.serving.images import VisionPrompts
from tgi_compat.modeling.source import resolve_model_source
from tgi_compat.modeling.vision.encoder import ImageEncoder
from tgi_compat.modeling.weights.loader import load_model_config
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.images import PromptImage
from tgi_compat.router.model_loading import fit_to_runner, load_runner
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.stall_sampler import stall_sampler_from_env

WARM_STREAMS = 4  # the warm-up round: more prompts than one 4,096-token prefill chunk holds at the 7B shape
IMAGE_PAD = 151655  # Qwen2(.5)-VL's <|image_pad|>; vision start/end 151652/151653
VISION_7B = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2, hidden_act="silu", in_channels=3,
)  # fmt: skip
# Qwen2-VL-7B's: Qwen2.5-VL-7B's depth, heads and patches, its width as embed_dim (hidden_size: the merger's output),
# a GELU MLP of mlp_ratio x the width, whole-image attention in every block
SHARED_7B = ("depth", "num_heads", "patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels")
QWEN2_VL_VISION_7B = {key: VISION_7B[key] for key in SHARED_7B} | dict(embed_dim=1280, mlp_ratio=4, hidden_size=3584)
TEXT_7B = {key: value for key, value in QWEN2_7B.items() if key not in ("architectures", "model_type")}
PRESETS = {
    "7b": (TEXT_7B | {"max_position_embeddings": 32768}, VISION_7B, 3136, 12845056),
    "tiny": (
        dict(vocab_size=152064, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6),
        dict(VISION_7B, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
             fullatt_block_indexes=[1], window_size=56),
        28 * 28, 28 * 28 * 16,
    ),
}  # fmt: skip


# --family -> (architecture, its vision config by preset; a preset not named keeps the preset's own, Qwen2.5-VL's)
FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", {}),
    "qwen2_vl": (
        "Qwen2VLForConditionalGeneration",
        {
            "7b": QWEN2_VL_VISION_7B,
            "tiny": dict(QWEN2_VL_VISION_7B, depth=2, embed_dim=32, num_heads=2, hidden_size=64),
        },
    ),
}


def write_folder(folder: Path, preset: str, family: str = "qwen2_5_vl") -> None:
    """config.json (the text sizes, M-RoPE 16/24/24 or the tiny head's split; the family's vision tower) and the
    image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text, vision, min_pixels, max_pixels = PRESETS[preset]
    architecture, visions = FAMILIES[family]
    vision = visions.get(preset, vision)
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    section = [16, 24, 24] if half == 64 else [half - 2 * (half // 3), half // 3, half // 3]
    rope = {"rope_type": "default", "mrope_section": section, "rope_theta": text.get("rope_theta", 1e6)}
    config = dict(
        architectures=[architecture], model_type=family, tie_word_embeddings=False,
        text_config=dict(text, model_type=f"{family}_text", rope_parameters=rope), vision_config=vision,
        image_token_id=IMAGE_PAD, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        eos_token_id=151645, bos_token_id=151643,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(folder)


def random_png(rng: np.random.Generator, size: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


Payload = tuple[bytes, tuple[int, int] | None]  # what the engine takes of an image: PromptImage's data and resized


def api_vision(folder: str, processes: int | None = None) -> VisionPrompts:
    """The API's own image prompts for this checkpoint (fetcher, resize), as the server builds them; `processes`: its
    decoders' (None: the server's default for this host)."""
    decoded = DecodedImages(decoder=None if processes is None else ImageDecoder(processes))
    vision = VisionPrompts.of(load_model_config(resolve_model_source(folder)), ImageFetcher(decoded=decoded), folder)
    assert vision is not None and vision.resize is not None, "the checkpoint's processor keeps its host path"
    return vision


def _api_process(folder: str, inbox: Any, outbox: Any, processes: int | None) -> None:
    """The API's side of the images phases, in a process of its own as the server's API is: each (index, path of a
    `![](data:...)`) from `inbox` is loaded by the API's own fetcher in its fetch threads (base64, the decode, the
    checkpoint's resize, its kept decoded images), and (index, path of the payload, resized) goes to `outbox`: a file
    beside it, so that no thread of the engine's process moves megabytes through a pipe (a pipe's 64 KiB reads,
    each taking the GIL back, held the engine's launches up)."""
    vision = api_vision(folder, processes)
    vision.fetcher.decoded.decoder.warm()  # as the server's warm-up does

    def load(index: int, path: str, resize: bool) -> None:
        try:
            image = vision.fetcher.load(ImageRef(Path(path).read_text()), vision.resize if resize else None)
            data, resized = image.payload
            Path(f"{path}.payload").write_bytes(data)
            outbox.put((index, f"{path}.payload", resized, time.perf_counter()))
        except Exception as error:  # any failure reaches the benchmark's thread
            outbox.put((index, None, repr(error), 0.0))

    while (item := inbox.get()) is not None:
        vision.fetcher.threads.submit(load, *item)
    # before this process's exit joins its children: an idle decode worker would wait for work forever
    vision.fetcher.decoded.decoder.close()


class ApiImages:
    """The API's process, for the images phases: `send` hands it PNGs (written as data URLs first, the client's
    upload, before any clock), `arrived` gives back each one's payload as the API sends it to the engine."""

    def __init__(self, folder: Path, processes: int | None = None) -> None:
        context = multiprocessing.get_context("spawn")  # (the engine's process has CUDA up: no fork)
        self.inbox, self.outbox = context.Queue(), context.Queue()
        args = (str(folder), self.inbox, self.outbox, processes)
        self.process = context.Process(target=_api_process, args=args)
        self.process.start()
        self.files = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self.count = 0
        self.send([self.stage(random_png(np.random.default_rng(1), 64))])  # up and warm
        self.arrived(block=True)

    def stage(self, png: bytes) -> str:
        self.count += 1
        path = self.files / f"{self.count}.md"
        path.write_text(image_markdown(f"data:image/png;base64,{base64.b64encode(png).decode()}"))
        return str(path)

    def send(self, paths: Sequence[str], resize: bool = True) -> None:
        """`resize` False: the API decodes each to validate it and sends the file, as before session 39."""
        for index, path in enumerate(paths):
            self.inbox.put((index, path, resize))

    def arrived(self, block: bool = False) -> list[tuple[int, Payload, float]]:
        """(index in its `send`, payload, perf_counter when the API sent it) of each image back since the last call
        (the clock is the host's monotonic one, shared by processes); `block`: at least one."""
        out: list[tuple[int, Payload, float]] = []
        while True:
            try:
                index, path, resized, sent = self.outbox.get(block=block and not out)
            except queue.Empty:
                return out
            if path is None:
                raise RuntimeError(f"the API refused an image: {resized}")
            out.append((index, (Path(path).read_bytes(), resized), sent))
            os.unlink(path)

    def close(self) -> None:
        self.inbox.put(None)
        self.process.join(timeout=10)
        shutil.rmtree(self.files, ignore_errors=True)


class Prompts:
    """Prompts of `text` random ids with one image after the first half of them."""

    def __init__(self, folder: Path, text: int, size: int, seed: int = 0):
        from tgi_compat.modeling.vision.qwen2_5_vl import PlaceholderGrid

        self.grid = PlaceholderGrid.from_folder(str(folder))(size, size)
        self.resize = api_vision(str(folder)).resize  # this process's, for what is resized before the clock
        self.text, self.size = text, size
        self.rng, self.pixels = random.Random(seed), np.random.default_rng(seed)
        self.count = 0

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 150000) for _ in range(n)]

    def request(
        self, image: bytes | None, new: int, ids: list[int] | None = None, payload: Payload | None = None
    ) -> GenerateRequest:
        """`image` (a PNG) None: the placeholders' positions hold random text ids instead (the same length).
        `payload`: the image as the API sends it (resized); None: the file, for `run` to send through ApiImages."""
        rows, columns = self.grid
        head, tail = self.text // 2, self.text - self.text // 2
        ids = ids or self.ids(head) + [151652] + self.ids(rows * columns) + [151653] + self.ids(tail)
        images = []
        if image is not None:
            ids = ids[: head + 1] + [IMAGE_PAD] * (rows * columns) + ids[head + 1 + rows * columns :]
            digest = hashlib.sha256(image).hexdigest()
            data, resized = payload or (image, None)
            images = [PromptImage(head + 1, rows * columns, digest, data, grid=(rows, columns), resized=resized)]
        self.count += 1
        return GenerateRequest(f"r{self.count}", ids, max_new_tokens=new, ignore_eos=True, images=images)

    def resized(self, image: bytes, new: int, ids: list[int] | None = None) -> GenerateRequest:
        """A request whose image the API already resized (here, before any clock)."""
        return self.request(image, new, ids, self.payload(image))

    def payload(self, image: bytes) -> Payload:
        """The API's decode and resize of `image`, here."""
        return decode_image(image, None, self.resize).payload

    def image(self) -> bytes:
        return random_png(self.pixels, self.size)


def run(
    engine: EngineCore,
    requests: Sequence[GenerateRequest],
    timed: EngineEncoderTimes | None = None,
    api: ApiImages | None = None,
    api_resizes: bool = True,
) -> dict:
    """All at once; TTFT of each (first token event - submit), output tok/s over the run, and the timeline of the
    steps until the last first token: [end ms, first tokens, images encoded] a step (images: with `timed`). `api`:
    each request whose image is a file goes to the engine once the API's process has loaded and resized it, on the
    same clock (its PNG handed over as a data URL when the clock starts)."""
    sent = [req for req in requests if api is not None and req.images and req.images[0].resized is None]
    paths = [api.stage(req.images[0].data) for req in sent] if api is not None else []
    start = time.perf_counter()
    if api is not None:
        api.send(paths, api_resizes)
    arriving = dict(enumerate(sent))
    staged = {id(req) for req in sent}
    for req in requests:
        if id(req) not in staged:
            engine.add_request(req)
    first: dict[str, float] = {}
    tokens = 0
    steps: list[tuple[float, int, int]] = []
    arrivals: list[float] = []  # ms at which the API's process sent each image back (the engine takes it a step later)
    stalls = stall_sampler_from_env()  # TGI_STALL_TRACE_MS: where the slow steps go
    while engine.has_unfinished() or arriving:
        for index, (data, resized), sent_at in (
            api.arrived(block=not engine.has_unfinished()) if arriving and api else []
        ):
            req = arriving.pop(index)
            arrivals.append(round(1e3 * (sent_at - start), 1))
            image = dataclasses.replace(req.images[0], data=data, resized=resized)
            engine.add_request(dataclasses.replace(req, images=[image]))
        images_before = timed.images_encoded if timed is not None else 0
        with stalls.turn() if stalls is not None else contextlib.nullcontext():
            events = engine.step()
        firsts = 0
        for event in events:
            if event.request_id not in first:
                first[event.request_id] = time.perf_counter() - start
                firsts += 1
            tokens += len(event.token_ids)
        if len(first) < len(requests) or firsts:
            images = timed.images_encoded - images_before if timed is not None else 0
            steps.append((round(1e3 * (time.perf_counter() - start), 1), firsts, images))
    elapsed = time.perf_counter() - start
    ttft = sorted(first[req.request_id] for req in requests)
    p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
    timings = dict(
        ttft_p50_ms=1e3 * statistics.median(ttft), ttft_p90_ms=1e3 * p90, tok_s=tokens / elapsed, steps=steps
    )
    return timings | (dict(arrivals=arrivals) if arrivals else {})


class _WaitedFuture(Future):
    """A preprocessing future whose result() adds how long it blocked the engine's thread to `waits`."""

    def __init__(self, inner: Future, waits: list[float]) -> None:
        super().__init__()
        self._waits = waits
        inner.add_done_callback(self._copy)

    def _copy(self, done: Future) -> None:
        error = done.exception()
        self.set_exception(error) if error is not None else self.set_result(done.result())

    def result(self, timeout: float | None = None):
        start = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._waits.append(time.perf_counter() - start)


class EngineEncoderTimes:
    """The image encoder as the engine calls it, accounted: per encoder call its images and its GPU time (CUDA
    events), and the engine thread's waits on the image processor's threads. `take()` returns and resets them."""

    def __init__(self, encoder: ImageEncoder) -> None:
        self.encoder = encoder
        self._calls: list[tuple[int, Callable[[], float]]] = []  # (images, its ms once the device is synchronised)
        self._waits: list[float] = []

    def preprocess_async(self, data: bytes, resized: tuple[int, int] | None = None) -> Future:
        return _WaitedFuture(self.encoder.preprocess_async(data, resized), self._waits)

    def encode(self, processed):
        if self.encoder.device.type != "cuda":
            start = time.perf_counter()
            out = self.encoder.encode(processed)
            ms = 1e3 * (time.perf_counter() - start)
            self._calls.append((len(processed), lambda: ms))
            return out
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = self.encoder.encode(processed)
        end.record()
        self._calls.append((len(processed), lambda: begin.elapsed_time(end)))
        return out

    @property
    def images_encoded(self) -> int:
        """Images through the encoder since the last take()."""
        return sum(count for count, _ in self._calls)

    def take(self) -> dict:
        if self.encoder.device.type == "cuda":
            torch.cuda.synchronize()
        ms = [elapsed() for _, elapsed in self._calls]
        images = [count for count, _ in self._calls]
        out = dict(calls=len(images), images=sum(images), encode_ms=sum(ms), preprocess_wait_ms=1e3 * sum(self._waits),
                   images_per_call=images, ms_per_call=[round(m, 2) for m in ms])  # fmt: skip
        self._calls, self._waits = [], []
        return out


def engine_for(
    folder: Path, args: argparse.Namespace
) -> tuple[EngineCore, ImageEncoder | None, EngineEncoderTimes | None]:
    """The engine (as EngineCore.from_config builds it), its runner's image encoder (timed on its own) and that
    encoder as the engine calls it, accounted."""
    # the encoder cache holds both images phases' rows (64 images of ~9.8 MB at 1024px): the cached phase hits
    config = EngineConfig(
        model_id=str(folder), device=args.device, dtype=args.dtype, load_format="dummy", image_cache_bytes=1 << 30
    )
    runner = load_runner(config)
    config = fit_to_runner(config, runner)
    encoder = runner.image_encoder
    timed = None if encoder is None else EngineEncoderTimes(encoder)
    return EngineCore(config, runner, runner.model_config, runner.lora, timed), encoder, timed


def encoder_timings(encoder: ImageEncoder, prompts: Prompts, counts: tuple[int, ...] = (1, 8), reps: int = 3) -> dict:
    """ms per image with `count` images per call: the API's host half (here, one image at a time), then the vision
    encoder alone."""
    sync = torch.cuda.synchronize if encoder.device.type == "cuda" else lambda: None
    out = {}
    for count in counts:
        files = [prompts.image() for _ in range(count)]
        start = time.perf_counter()
        payloads = [prompts.payload(data) for data in files]
        preprocess = time.perf_counter() - start
        on_device = encoder.batch([encoder.preprocess(data, resized) for data, resized in payloads])
        sync()
        encoder.model.encode_processed(on_device)  # warm-up: this count's shapes
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            encoder.model.encode_processed(on_device)
        sync()
        encode = (time.perf_counter() - start) / reps
        out[count] = dict(preprocess_ms_per_image=1e3 * preprocess / count, encode_ms_per_image=1e3 * encode / count)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl", help="whose vision tower")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--text", type=int, default=64, help="text ids around the image")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--skip-plain", action="store_true", help="no plain Qwen2 engine for the text-only row")
    parser.add_argument("--reruns", type=int, default=0, help="after the other phases, the images phase again")
    parser.add_argument(
        "--engine-side",
        action="store_true",
        help="after each rerun, one as before session 39: the API decodes each PNG to validate it and sends the file, "
        "which the engine's threads decode again and resize",
    )
    parser.add_argument(
        "--torch-threads",
        default="",
        help="after each rerun, one with the engine's PyTorch intra-op threads set to each of these (the engine runs "
        f"with {torch.get_num_threads()} here, one on a GPU: router/model_loading._gpu_host_threads)",
    )
    parser.add_argument(
        "--api-processes",
        default="",
        help="after each rerun, one with the API's decoders in each of these numbers of processes (0: its fetch "
        f"threads; the server's default on this host: {decode_processes()})",
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="qwen-vl-bench-"))
    write_folder(folder, args.preset, args.family)
    prompts = Prompts(folder, args.text, args.size)
    api = ApiImages(folder)
    start = time.perf_counter()
    engine, encoder, timed = engine_for(folder, args)
    assert encoder is not None and timed is not None
    results: dict = dict(family=args.family, preset=args.preset, grid=prompts.grid, load_s=time.perf_counter() - start)
    run(engine, [prompts.request(prompts.image(), 2)], api=api)  # warm-up: kernels, the encoder's first call
    # and a full prefill chunk with images, then decodes beside a prefill: before session 37 the images phase was the
    # first to run such steps, and its first step took 182-326 ms against 36-79 ms for the phases after it
    # (preprocessed, cached, text), whatever paid once for a step's first run landing in the images' TTFT alone
    run(engine, [prompts.request(prompts.image(), 2) for _ in range(WARM_STREAMS)], api=api)
    results["encoder"] = encoder_timings(encoder, prompts)
    timed.take()
    images = [prompts.request(prompts.image(), args.new) for _ in range(args.streams)]
    results["images"] = run(engine, images, timed, api)
    results["images_encoder"] = timed.take()
    files = [prompts.image() for _ in range(args.streams)]
    results["images_preprocessed"] = run(engine, [prompts.resized(data, args.new) for data in files], timed)
    results["images_preprocessed_encoder"] = timed.take()
    results["images_cached"] = run(engine, [prompts.resized(data, args.new) for data in files], timed)
    results["images_cached_encoder"] = timed.take()
    results["text"] = run(engine, [prompts.request(None, args.new) for _ in range(args.streams)])
    picture = prompts.image()
    first = prompts.request(picture, args.new)
    results["repeat_first"] = run(engine, [first], api=api)
    results["repeat_again"] = run(engine, [prompts.request(picture, args.new, list(first.prompt_ids))], api=api)
    plain_prompts = [prompts.ids(args.text) for _ in range(args.streams)]
    text_only = [GenerateRequest(f"t{i}", ids, max_new_tokens=args.new, ignore_eos=True) for i, ids in enumerate(plain_prompts)]  # fmt: skip
    results["text_only_vl"] = run(engine, text_only)
    for index in range(args.reruns):  # the images phase again: what its first run pays that later ones do not
        timed.take()  # (the repeat phases' image)
        requests = [prompts.request(prompts.image(), args.new) for _ in range(args.streams)]
        results[f"images_again_{index}"] = run(engine, requests, timed, api) | dict(encoder=timed.take())
        for processes in (int(n) for n in args.api_processes.split(",") if n):
            other = ApiImages(folder, processes)
            requests = [prompts.request(prompts.image(), args.new) for _ in range(args.streams)]
            decoders = run(engine, requests, timed, other) | dict(encoder=timed.take())
            results[f"images_api_processes_{processes}_{index}"] = decoders
            other.close()
        for threads in (int(n) for n in args.torch_threads.split(",") if n):
            engine_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
            requests = [prompts.request(prompts.image(), args.new) for _ in range(args.streams)]
            results[f"images_torch_threads_{threads}_{index}"] = run(engine, requests, timed, api) | dict(
                encoder=timed.take()
            )
            torch.set_num_threads(engine_threads)
        if args.engine_side:
            requests = [prompts.request(prompts.image(), args.new) for _ in range(args.streams)]
            engine_side = run(engine, requests, timed, api, api_resizes=False)
            results[f"images_engine_side_{index}"] = engine_side | dict(encoder=timed.take())
    api.close()
    if not args.skip_plain:
        del engine, encoder
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the VL engine's KV pool back before the plain one sizes its own
        plain = folder / "plain"
        text_config = PRESETS[args.preset][0]
        plain.mkdir()
        (plain / "config.json").write_text(json.dumps(dict(text_config, architectures=["Qwen2ForCausalLM"], model_type="qwen2")))  # fmt: skip
        engine, _, _ = engine_for(plain, args)
        run(engine, [GenerateRequest("warm", prompts.ids(args.text), max_new_tokens=2, ignore_eos=True)])
        again = [GenerateRequest(f"p{i}", ids, max_new_tokens=args.new, ignore_eos=True) for i, ids in enumerate(plain_prompts)]  # fmt: skip
        results["text_only_plain"] = run(engine, again)
    print(table(results, args), flush=True)
    write_json(out_path("qwen_vl.json" if args.family == "qwen2_5_vl" else f"{args.family}.json"), results)


def table(results: dict, args: argparse.Namespace) -> str:
    rows = [f"{args.family} {args.preset}, {args.dtype}, image {args.size}x{args.size} -> grid {results['grid']}", ""]
    rows += ["| phase | TTFT p50 ms | TTFT p90 ms | out tok/s |", "|---|---|---|---|"]
    phases = ("images", "images_preprocessed", "images_cached", "text")
    for name in (*phases, "repeat_first", "repeat_again", "text_only_vl", "text_only_plain"):
        if name in results:
            r = results[name]
            rows.append(f"| {name} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {r['tok_s']:.0f} |")
    rows += ["", "| images per encoder call | API host half ms/image | encoder ms/image |", "|---|---|---|"]
    for count, r in results["encoder"].items():
        rows.append(f"| {count} | {r['preprocess_ms_per_image']:.1f} | {r['encode_ms_per_image']:.1f} |")
    for phase in phases[:3]:
        inside = results[f"{phase}_encoder"]
        rows += ["", f"{phase} phase, inside the engine: {inside['images']} images in {inside['calls']} encoder calls "
                 f"({inside['images_per_call']}), {inside['encode_ms']:.0f} ms of encoder GPU time "
                 f"({inside['ms_per_call']} ms); the engine's "
                 f"thread waited {inside['preprocess_wait_ms']:.0f} ms for image preprocessing"]  # fmt: skip
    for phase in phases:  # where the first tokens come: a step's end ms, first tokens (+ images encoded)
        marks = [f"{t:.0f}:{n}" + (f"+{i}im" if i else "") for t, n, i in results[phase]["steps"]]
        rows += ["", f"{phase} phase, steps to the last first token (end ms:first tokens+images): {' '.join(marks)}"]
    image_ratio = results["images"]["ttft_p50_ms"] / results["text"]["ttft_p50_ms"]
    repeat_ratio = results["repeat_again"]["ttft_p50_ms"] / results["repeat_first"]["ttft_p50_ms"]
    floor = encoder_floor(results)
    text = results["text"]["ttft_p50_ms"]
    preprocessed, cached = (results[name]["ttft_p50_ms"] / text for name in ("images_preprocessed", "images_cached"))
    results["checks"] = dict(image_vs_text=image_ratio, repeat_vs_first=repeat_ratio, encoder_floor=floor,
                             preprocessed_vs_text=preprocessed, cached_vs_text=cached)  # fmt: skip
    rows += ["", f"images/text TTFT p50: {image_ratio:.2f} (target <= 1.5); repeat/first: {repeat_ratio:.2f} (<= 0.3)",
             f"of which: preprocessed/text {preprocessed:.2f} (no API host work), cached/text {cached:.2f} (no encoder)",
             f"its floor, the text phase's p50 plus the images encoded by the median first token at the encoder's "
             f"best ms per image alone, nothing else: {floor:.2f}"]  # fmt: skip
    reruns = [
        name
        for name in results
        if name.startswith(("images_again_", "images_api_processes_", "images_torch_threads_", "images_engine_side_"))
    ]
    for name in reruns:  # images_<kind>_<index> -> "images <kind> (<index + 1>)"
        kind, index = name.removeprefix("images_").rsplit("_", 1)
        label = f"images {kind.replace('_', '-')} ({int(index) + 1})"
        again = results[name]
        timeline = " ".join(f"{t:.0f}:{n}" + (f"+{i}im" if i else "") for t, n, i in again["steps"])
        rows.append(f"{label}: TTFT p50 {again['ttft_p50_ms']:.1f} ms, {again['ttft_p50_ms'] / text:.2f}x "
                    f"text's; steps {timeline}")  # fmt: skip
    if "text_only_plain" in results:
        ratio = results["text_only_vl"]["tok_s"] / results["text_only_plain"]["tok_s"]
        results["checks"]["text_only_vl_vs_plain"] = ratio
        rows.append(f"text-only tok/s, VL engine / plain Qwen2: {ratio:.3f} (target within 3%)")
    return "\n".join(rows)


def encoder_floor(results: dict) -> float:
    """(text TTFT p50 + the images encoded until the images phase's median first token x the encoder's best ms per
    image alone) / text TTFT p50: the images/text ratio if the images cost their encoder time and nothing else."""
    steps, streams = results["images"]["steps"], sum(firsts for _, firsts, _ in results["images"]["steps"])
    images = firsts = 0
    for _, step_firsts, step_images in steps:
        images += step_images
        firsts += step_firsts
        if 2 * firsts >= streams:
            break
    best = min(r["encode_ms_per_image"] for r in results["encoder"].values())
    return (results["text"]["ttft_p50_ms"] + images * best) / results["text"]["ttft_p50_ms"]


if __name__ == "__main__":
    main()
