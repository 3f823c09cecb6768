"""A Qwen-VL image processor's work, split between the host and the device. The host keeps what must see the decoded
picture, Pillow's resize to `smart_resize`'s sides, and sends the resized image's uint8 bytes. The device does the
rest: the patch flattening (a fixed reordering that repeats each frame temporal_patch_size times) and
`(x * rescale_factor - mean) / std`.

On the host, the Pillow processor took 43 ms for a 1024px PNG already decoded (2-core development machine), and its
resize alone 13 ms. The rest was numpy reordering and float conversion, in threads beside the engine's. On an H100, 32
streams of a 1024px image had TTFT p50 1,029-1,100 ms, against 864-896 ms for images processed before they were sent
(session 37, with the GPU image's torchvision processor; some of that gap may have been the benchmark's first run of
such steps). The flattened patches are also twice the resized image's bytes, to page-lock and upload."""

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
        if type(processor).__name__ not in QWEN_VL_PROCESSORS:
            return None
        patchify = cls(
            PlaceholderGrid.of(processor),
            processor.patch_size,
            processor.merge_size,
            processor.temporal_patch_size,
            int(processor.resample),
        )
        return patchify if patchify.reproduces(processor) else None

    def resize(self, image: Image.Image) -> dict[str, torch.Tensor]:
        """The host half: an RGB image -> {RESIZED: [H, W, 3] uint8, "image_grid_thw": [1, 3]}."""
        rows, columns = self.grid(image.height, image.width)
        resized = image.resize((columns * self.grid.factor, rows * self.grid.factor), resample=self.resample)
        side = self.grid.factor // self.patch  # patches per placeholder side
        grid = torch.tensor([[1, rows * side, columns * side]])
        return {RESIZED: torch.from_numpy(np.array(resized)), "image_grid_thw": grid}

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
