"""Image files -> each image's placeholder rows: the checkpoint's own image processor (transformers',
from its preprocessor_config.json), then the model's vision encoder. The engine starts an image's processing when its
request is queued and encodes, once a step, the images of the step it has not cached (tgi_compat.router.image_cache).

The processor runs on the host, image by image in a thread pool; the pool's outputs are concatenated along their
first dimension (Qwen2.5-VL's patches and grids, Gemma 3's images) as the processor would batch them itself.
Qwen-VL's processors do less on the host: Pillow's resize alone, which the API's process runs before the image comes
here (an image file that comes here is decoded and resized in the pool), and the patch flattening and the
normalisation run on the device (`vision/qwen_vl_pixels.py`)."""

from __future__ import annotations

import functools
import io
import os
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Protocol

import torch
from PIL import Image

from tgi_compat.modeling import copy_streams
from tgi_compat.modeling.vision.processors import image_processor
from tgi_compat.modeling.vision.qwen_vl_pixels import RESIZED, DeviceNormalize, DevicePatchify


class VisionLanguageModel(Protocol):
    # its image placeholders attend to each other both ways during prefill (Gemma 3's images, PaliGemma's prompt):
    # the attention backend's span variants are compiled at start-up
    bidirectional_images: ClassVar[bool]

    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's tensors (pixel_values, and Qwen2.5-VL's image_grid_thw) -> each image's
        placeholder rows [tokens, hidden]."""
        ...


# Images preprocessed at once: eight at once slowed each one, and the first step waits for its prompts' images
# (about three 1024px prompts fill a step's prefill budget). Qwen2.5-VL, 32 streams of a 1024px image on an H100:
# 3 threads gave TTFT p50 1.86 / 1.84x text's against 1.97 / 1.92x with 8, the first step done at 155 / 150 ms
# against 234 / 224 (session 36, two runs each, in both orders).
PROCESSOR_THREADS = 3
HOST_TENSORS = frozenset({"image_grid_thw"})  # processor outputs the encoder reads on the host


class ImageEncoder:
    def __init__(self, model: VisionLanguageModel, folder: str, device: torch.device):
        self.model = model
        self.folder = folder
        self.device = device
        # images preprocessed at once (capped by the host's cores); read when the first image starts its pool
        self.processor_threads = PROCESSOR_THREADS

    @property
    def bidirectional(self) -> bool:
        return self.model.bidirectional_images

    @functools.cached_property
    def processor(self) -> Any:
        """Loaded with the first image: a checkpoint served text-only needs no preprocessor_config.json."""
        return image_processor(self.folder)

    @functools.cached_property
    def normalize(self) -> DeviceNormalize | None:
        return DeviceNormalize.of(self.processor, self.device)

    @functools.cached_property
    def patchify(self) -> DevicePatchify | None:
        """Qwen-VL's patch flattening on the device too, where the normalisation is (the host resizes alone)."""
        return DevicePatchify.of(self.processor)

    @functools.cached_property
    def threads(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            min(self.processor_threads, os.cpu_count() or 1), thread_name_prefix="image-processor"
        )

    def preprocess(self, data: bytes, resized: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """One image file -> the processor's tensors for it alone (on the host). `resized` (height, width): `data`
        is the image already through `patchify.resized` (by the API), its RGB rows."""
        if resized is not None:
            if self.patchify is None:
                raise ValueError("resized pixels came for a model whose processor runs whole on the host")
            with warnings.catch_warnings():  # read only: page-locked by a copy (`_upload`) before anything uses it
                warnings.simplefilter("ignore", UserWarning)
                pixels = torch.frombuffer(data, dtype=torch.uint8)
            return self.patchify.host_tensors(pixels.view(*resized, 3))
        image = Image.open(io.BytesIO(data)).convert("RGB")
        if self.patchify is not None:  # resized alone: flattened and normalised on the device
            return self.patchify.resize(image)
        if self.normalize is None:
            out = self.processor(images=[image], return_tensors="pt")
        else:  # integer pixel values, normalised on the device
            out = self.processor(images=[image], return_tensors="pt", do_rescale=False, do_normalize=False)
            out["pixel_values"] = out["pixel_values"].to(torch.uint8)
        # tensors only: Mllama's also lists its tiles (num_tiles), which its aspect_ratio_mask holds too
        return {name: value for name, value in out.items() if isinstance(value, torch.Tensor)}

    def preprocess_async(self, data: bytes, resized: tuple[int, int] | None = None) -> Future[dict[str, torch.Tensor]]:
        """`preprocess` started in the pool: the engine starts it when the request is queued (EncoderCache.prefetch).
        Pixels the API resized are a view of their bytes at once, with no thread."""
        self.patchify  # noqa: B018 - the processor loaded once here, not by each thread at once
        if resized is None:
            return self.threads.submit(self.preprocess, data)
        done: Future[dict[str, torch.Tensor]] = Future()
        done.set_result(self.preprocess(data, resized))
        return done

    def preprocess_all(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """The processor's tensors of all `images`, on the device, as one call of the processor would give them."""
        return self.batch([future.result() for future in [self.preprocess_async(data) for data in images]])

    def batch(self, processed: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The images' tensors concatenated, on the device but for the few host-side numbers that plan the encoder's
        launches (Qwen-VL's grid: read back from the device, it made the host wait for the steps queued before).
        Each image's tensors go up on their own, without waiting, and are concatenated there."""
        if self.patchify is not None:  # each resized image up, then flattened into its patches there
            out = {
                "pixel_values": torch.cat([self.patchify(self._upload(p[RESIZED])) for p in processed]),
                "image_grid_thw": torch.cat([p["image_grid_thw"] for p in processed]),
            }
        else:
            out = {
                name: _cat_padded(tensors) if name in HOST_TENSORS else _cat_padded([self._upload(t) for t in tensors])
                for name in processed[0]
                for tensors in [[p[name] for p in processed]]
            }
        if self.normalize is not None:
            out["pixel_values"] = self.normalize(out["pixel_values"])
        return out

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked here, then copied on the side stream beside the step in flight: from pageable memory the copy
        made this thread wait for every kernel queued before it (the GPU then idled through this step's launches:
        TTFT 2.0x text's at 32 streams, H100). Page-locked in the processor's threads instead, each image took a
        fresh pinned block, whose allocations stalled the engine's launches (3.4x)."""
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return copy_streams.upload(tensor.pin_memory(), self.device)  # (the caching host allocator reuses blocks)

    @torch.inference_mode()
    def encode(self, processed: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Images already through `preprocess` -> each one's placeholder rows, in one encoder call."""
        return self.model.encode_processed(self.batch(processed))


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated along dim 0, each zero-padded at the end of its other dims to the largest: LLaVA-Next's images
    bring different numbers of tiles ([1, tiles, 3, H, W]), which its processor pads so when it batches them."""
    if len(tensors) == 1:
        return tensors[0]
    shape = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    padded = []
    for t in tensors:
        pad = [p for size, most in zip(reversed(t.shape[1:]), reversed(shape)) for p in (0, most - size)]
        padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)
