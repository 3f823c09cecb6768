"""A Qwen-VL image processor's work, split between the host and the device. The host keeps what must see the decoded
picture, Pillow's resize to `smart_resize`'s sides, and sends the resized image's uint8 bytes. The device does the
rest: the patch flattening (a fixed reordering that repeats each frame temporal_patch_size times) and
`(x * rescale_factor - mean) / std`.

The host half runs in the API's process, in the thread that decodes the image to validate it
(tgi_compat.api.serving.images): the engine's process then only page-locks and uploads the pixels, with no work
beside its own thread under its GIL. Before session 39 the engine's threads decoded every file a second time and
resized it there. On the 2-core development machine a 1024px PNG's decode took 19-20 ms and its resize 13 ms; on the
H100 host both took 52 ms. The flattened patches are also twice the resized image's bytes, to send, page-lock and
upload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from tgi_compat.modeling.vision.qwen2_5_vl import PlaceholderGrid

# processors whose pixel_values are flattened patches [patches, C * t * p * p], channel-major within a patch row
QWEN_VL_PROCESSORS = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast"})
RESIZED = "resized"  # DevicePatchify's host output: the resized image [H, W, C] uint8


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


@dataclass(frozen=True)
class DevicePatchify:
    """The processor's resize on the host, then its patch flattening on the device. `of` builds one only where that
    gives the processor's own patches exactly: on a probe image, against the processor itself. A processor whose resize
    is not Pillow's (transformers' torchvision one) keeps the host path."""

    grid: PlaceholderGrid  # the resized sides: smart_resize's, as the API counts the placeholders
    patch: int
    merge: int
    temporal: int
    resample: int  # the processor's Pillow filter

    @classmethod
    def of(cls, processor: Any) -> DevicePatchify | None:
        """None where DeviceNormalize has none (the device half normalises the patches it flattens)."""
        if type(processor).__name__ not in QWEN_VL_PROCESSORS or not (processor.do_rescale and processor.do_normalize):
            return None
        patchify = cls(
            PlaceholderGrid.of(processor),
            processor.patch_size,
            processor.merge_size,
            processor.temporal_patch_size,
            int(processor.resample),
        )
        return patchify if patchify.reproduces(processor) else None

    def sides(self, height: int, width: int) -> tuple[int, int]:
        """smart_resize's (height, width) for an image of these (the API's process resizes to them where it decodes
        the image, and sends the resized image's bytes)."""
        rows, columns = self.grid(height, width)
        return rows * self.grid.factor, columns * self.grid.factor

    def resized(self, image: Image.Image) -> Image.Image:
        """The host half: an RGB image at `sides`."""
        height, width = self.sides(image.height, image.width)
        return image.resize((width, height), resample=self.resample)

    def host_tensors(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The resized pixels [H, W, 3] -> {RESIZED: them, "image_grid_thw": [1, 3]}, what `batch` uploads."""
        height, width, _ = pixels.shape
        return {RESIZED: pixels, "image_grid_thw": torch.tensor([[1, height // self.patch, width // self.patch]])}

    def resize(self, image: Image.Image) -> dict[str, torch.Tensor]:
        """Both host steps at once: an RGB image -> `host_tensors` of it resized."""
        return self.host_tensors(torch.from_numpy(np.array(self.resized(image))))  # (writable: a copy)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """The device half: [H, W, C] -> the processor's flattened patches [patches, C * t * p * p], in its order
        (merge blocks of patches row by row; within a row, channel, then frame, then the patch's pixels)."""
        height, width, channels = image.shape
        p, m = self.patch, self.merge
        blocks = image.permute(2, 0, 1).reshape(channels, height // (p * m), m, p, width // (p * m), m, p)
        blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6).unsqueeze(5)  # [gh/m, gw/m, m, m, C, 1, p, p]
        frames = blocks.expand(*blocks.shape[:5], self.temporal, p, p)
        return frames.reshape((height // p) * (width // p), channels * self.temporal * p * p)

    def reproduces(self, processor: Any) -> bool:
        """This split gives the processor's own integer patches and grid, on a random image it must resize."""
        probe = Image.fromarray(np.random.default_rng(0).integers(0, 256, (75, 131, 3), dtype=np.uint8))
        theirs = processor(images=[probe], return_tensors="pt", do_rescale=False, do_normalize=False)
        ours = self.resize(probe)
        patches = self(ours[RESIZED]).to(theirs["pixel_values"].dtype)
        return torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"]) and torch.equal(
            patches, theirs["pixel_values"]
        )
