"""Image files -> each image's placeholder rows: the checkpoint's own image processor (transformers',
from its preprocessor_config.json), then the model's vision encoder. The engine starts an image's processing when its
request is queued and encodes, once a step, the images of the step it has not cached (tgi_compat.router.image_cache).

The processor runs on the host, image by image in a thread pool: a 1024x1024 image takes ~100 ms of Pillow
decoding and resizing and numpy normalising and patch reordering, all of which release the GIL; the pool's outputs
are concatenated along their first dimension (Qwen2.5-VL's patches and grids, Gemma 3's images) as the processor
would batch them itself. Qwen-VL's processors leave the rescale and normalisation to the device
(`DeviceNormalize`): about half of their host time, and a quarter of the bytes to page-lock and upload."""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from PIL import Image

from tgi_compat.modeling import copy_streams


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
# processors whose pixel_values are flattened patches [patches, C * t * p * p], channel-major within a patch row
QWEN_VL_PROCESSORS = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast"})


@dataclass(frozen=True)
class DeviceNormalize:
    """A Qwen-VL processor's `(x * rescale_factor - mean) / std`, column by column of its flattened patches, as one
    multiply-add on the device: the processor runs with do_rescale and do_normalize off, so its patches hold the
    resized image's integer pixel values (sent as uint8). Within 3e-7 of the processor's own float32 output."""

    scale: torch.Tensor  # [C * t * p * p] float32: rescale_factor / std of each column's channel
    shift: torch.Tensor  # -mean / std

    @classmethod
    def of(cls, processor: Any, device: torch.device) -> DeviceNormalize | None:
        """None where the processor is not a Qwen-VL one or does not both rescale and normalise."""
        if type(processor).__name__ not in QWEN_VL_PROCESSORS or not (processor.do_rescale and processor.do_normalize):
            return None
        per_channel = processor.temporal_patch_size * processor.patch_size**2  # columns of one channel
        mean = torch.tensor(processor.image_mean, dtype=torch.float64).repeat_interleave(per_channel)
        std = torch.tensor(processor.image_std, dtype=torch.float64).repeat_interleave(per_channel)
        scale, shift = processor.rescale_factor / std, -mean / std
        return cls(scale.to(device, torch.float32), shift.to(device, torch.float32))

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, pixels.float(), self.scale)


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
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.folder)

    @functools.cached_property
    def normalize(self) -> DeviceNormalize | None:
        return DeviceNormalize.of(self.processor, self.device)

    @functools.cached_property
    def threads(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            min(self.processor_threads, os.cpu_count() or 1), thread_name_prefix="image-processor"
        )

    def preprocess(self, data: bytes) -> dict[str, torch.Tensor]:
        """One image file -> the processor's tensors for it alone (on the host)."""
        image = Image.open(io.BytesIO(data)).convert("RGB")
        if self.normalize is None:
            out = self.processor(images=[image], return_tensors="pt")
        else:  # integer pixel values, normalised on the device
            out = self.processor(images=[image], return_tensors="pt", do_rescale=False, do_normalize=False)
            out["pixel_values"] = out["pixel_values"].to(torch.uint8)
        # tensors only: Mllama's also lists its tiles (num_tiles), which its aspect_ratio_mask holds too
        return {name: value for name, value in out.items() if isinstance(value, torch.Tensor)}

    def preprocess_async(self, data: bytes) -> Future[dict[str, torch.Tensor]]:
        """`preprocess` started in the pool: the engine starts it when the request is queued (EncoderCache.prefetch)."""
        self.normalize  # noqa: B018 - the processor loaded once here, not by each thread at once
        return self.threads.submit(self.preprocess, data)

    def preprocess_all(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """The processor's tensors of all `images`, on the device, as one call of the processor would give them."""
        return self.batch([future.result() for future in [self.preprocess_async(data) for data in images]])

    def batch(self, processed: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The images' tensors concatenated, on the device but for the few host-side numbers that plan the encoder's
        launches (Qwen-VL's grid: read back from the device, it made the host wait for the steps queued before).
        Each image's tensors go up on their own, without waiting, and are concatenated there."""
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
